"""Action bounds: :class:`ClampAction` clamps the executed action to the bounds of the
environment's action spec (or given ones), on the environment's side only: the tensordict a
collector stores keeps the policy's unclamped action (see :mod:`~torchrl_flowpolicy.envs.chunking`)."""

from __future__ import annotations

import torch
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.data import Bounded, Composite
from torchrl.envs.transforms import Transform

__all__ = ["ClampAction"]


class ClampAction(Transform):
    """Clamp the executed action to per-dimension bounds; keep the policy's action stored.

    Flow policies write unbounded actions. This transform clamps the action the environment
    executes to ``[low, high]`` elementwise, on the inverse (policy to environment) path only:
    TorchRL applies inverse transforms to a shallow copy of the step's tensordict, so the
    tensordict a rollout or a collector keeps holds the policy's unclamped ``"action"``, next
    to its chain and log-probs, and rescoring them in the learner stays exact. The action
    spec is left as it is (it already describes the box the environment accepts).

    The bounds are the ``low`` / ``high`` of the environment's (bounded) action spec, per
    dimension, or given explicitly. TorchRL's :class:`~torchrl.envs.transforms.ClipTransform`
    does the same on the inverse path, but with scalar bounds only. On a chunked environment,
    place it after :class:`ChunkedAction` (``make_chunked_env(..., clamp_actions=True)``): it
    then clamps every row of the chunk; on an unwrapped environment, append it directly.

    Args:
        action_key: the action entry to clamp (default ``"action"``).

    Keyword Args:
        low: the lower bounds, a tensor broadcastable to the action (with ``high``); default:
            the action spec's.
        high: the upper bounds; default: the action spec's.

    Raises:
        ValueError: only one of ``low`` / ``high`` given, a bound that is not finite, or
            ``low > high`` somewhere; when the environment is built, bounds whose shape does
            not broadcast to the action's, or a bounded action spec with non-finite bounds;
            at step time, bounds read from an action spec that is not bounded.

    Examples:
        >>> from torchrl.envs import GymEnv, TransformedEnv
        >>> env = TransformedEnv(GymEnv("HalfCheetah-v5"), ClampAction())
        >>> td = env.reset().set("action", torch.full((6,), 3.0))
        >>> td = env.step(td)
        >>> td["action"].max().item()  # stored as written; HalfCheetah executed 1.0
        3.0
    """

    def __init__(
        self,
        action_key: NestedKey = "action",
        *,
        low: Tensor | float | None = None,
        high: Tensor | float | None = None,
    ):
        super().__init__(
            in_keys=[], out_keys=[], in_keys_inv=[action_key], out_keys_inv=[action_key]
        )
        if (low is None) != (high is None):
            raise ValueError("ClampAction takes both low and high, or neither (the spec's).")
        if low is not None:
            low, high = torch.as_tensor(low), torch.as_tensor(high)
            _check_bounds(low, high, "low= and high=")
        self.register_buffer("low", low)
        self.register_buffer("high", high)

    def transform_input_spec(self, input_spec: Composite) -> Composite:
        # When the environment is built: the bounds must fit the action it executes.
        input_spec = super().transform_input_spec(input_spec)
        key = self.in_keys_inv[0]
        spec = input_spec["full_action_spec"][key]
        if self.low is None:
            if isinstance(spec, Bounded):  # a spec that is not bounded fails at step time
                _check_bounds(spec.space.low, spec.space.high, f"the action spec of {key!r}")
            return input_spec
        for name, bound in (("low", self.low), ("high", self.high)):
            try:
                torch.broadcast_shapes(bound.shape, spec.shape)
            except RuntimeError:
                raise ValueError(
                    f"ClampAction's {name} has shape {tuple(bound.shape)}, which does not "
                    f"broadcast to the action {key!r} of shape {tuple(spec.shape)}."
                ) from None
            if torch.broadcast_shapes(bound.shape, spec.shape) != spec.shape:
                raise ValueError(
                    f"ClampAction's {name} has shape {tuple(bound.shape)}: it would broadcast "
                    f"the action {key!r} of shape {tuple(spec.shape)} to a larger one."
                )
        return input_spec

    def _bounds(self) -> tuple[Tensor, Tensor]:
        if self.low is not None:
            return self.low, self.high
        parent = self.parent
        if parent is None:
            raise RuntimeError(
                "ClampAction reads its bounds from the environment's action spec: append it to "
                "an environment, or pass low= and high=."
            )
        key = self.in_keys_inv[0]
        spec = parent.full_action_spec[key]
        if not isinstance(spec, Bounded):
            raise ValueError(
                f"ClampAction clamps to the bounds of the action spec, but the spec of {key!r} "
                f"is {type(spec).__name__}, not bounded; pass low= and high=."
            )
        return spec.space.low, spec.space.high

    def _inv_apply_transform(self, action: Tensor) -> Tensor:
        low, high = self._bounds()
        return action.clamp(low.to(action), high.to(action))


def _check_bounds(low: Tensor, high: Tensor, source: str) -> None:
    """Refuse clamping bounds that are not finite or cross (``low > high``), naming
    ``source`` (a NaN bound would make every executed action NaN)."""
    for name, bound in (("low", low), ("high", high)):
        if not torch.isfinite(bound).all():
            raise ValueError(
                f"ClampAction needs finite bounds; {name} of {source} holds "
                f"{bound[~torch.isfinite(bound)].unique().tolist()}."
            )
    if (low > high).any():
        raise ValueError(f"ClampAction needs low <= high in every dimension ({source}).")
