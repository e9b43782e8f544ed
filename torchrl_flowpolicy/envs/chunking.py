"""Chunked execution: one policy decision executes a chunk of ``H'`` environment steps.

:class:`ChunkedAction` is a TorchRL :class:`~torchrl.envs.transforms.MultiAction` with a fixed
chunk length whose reward is the decision's reward: the sum of the rewards of the steps the
environment actually executed. It steps the environment once per row of the chunk and stops
at the first done; in a batched environment (:class:`~torchrl.envs.SerialEnv`,
:class:`~torchrl.envs.ParallelEnv`) a sub-environment that is done mid-chunk is skipped for
the rest of the chunk (TorchRL's ``"_step"`` partial-step mask) while the others go on, and
only its executed steps count towards its reward.

The decision's ``done`` / ``terminated`` / ``truncated`` and next observation are those of
the last executed step, so a rollout with ``break_when_any_done=False`` (or a collector)
resets a sub-environment after the decision in which it finished, like any other step.

Frame accounting: a collector's frames count decisions. Each decision writes the number of
environment steps it executed, ``("next", "env_steps")`` (``[*B, 1]`` int64, ``0..H'``; 0 at
reset and for a sub-environment that a partial step skipped), so
``batch["next", "env_steps"].sum()`` is a batch's environment-step count.

Action bounds: :class:`ClampAction` (``make_chunked_env(..., clamp_actions=True)``) clamps
the executed actions to the bounds of the environment's action spec, per dimension, on the
environment's side: the tensordict a collector stores keeps the policy's unclamped action.

Per-decision discount: a decision spans up to ``H'`` environment steps, and its reward is the
undiscounted sum of those steps' rewards. A value estimator running at the decision level
(GAE on the collected decisions) should use ``gamma_decision = gamma_step ** H'`` to keep the
effective horizon of a per-step ``gamma_step``; :func:`decision_discount` computes it.
Within a chunk the rewards are not discounted (the usual semi-MDP approximation for short
chunks).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.data import Bounded, Composite, TensorSpec
from torchrl.envs import Compose, EnvBase, TransformedEnv
from torchrl.envs.transforms import MultiAction, Transform

from torchrl_flowpolicy.envs.clamping import ClampAction
from torchrl_flowpolicy.flow.sde import check_integer

__all__ = ["ChunkedAction", "ClampAction", "make_chunked_env", "decision_discount"]

#: Where :class:`ChunkedAction` writes the environment steps each decision executed.
ENV_STEPS_KEY = "env_steps"


class ChunkedAction(MultiAction):
    """Execute a chunk of ``executed_chunk_length`` actions per step; the reward is their sum.

    The action spec becomes ``[*B, executed_chunk_length, *action_shape]`` (a fixed length, so
    specs, random actions, fake tensordicts and storages know the shape); the reward spec keeps
    the base environment's shape (a bounded reward's bounds are widened to those of a sum of
    ``1..executed_chunk_length`` rewards).

    Row ``h`` of the chunk is the action of the ``h``-th environment step. Rows
    ``0..executed_chunk_length-2`` are executed while the action is read; the last row is
    executed by the outer step, so transforms placed after this one run once per decision, and
    transforms placed before it (or inside the wrapped environment) run on every environment
    step.

    Differences from :class:`~torchrl.envs.transforms.MultiAction`: the chunk length is fixed
    and checked; the reward is summed over the executed steps with an explicit per-sub-env
    mask (MultiAction's stacked rewards of a batch-locked batched environment repeat the
    stale reward of a sub-environment skipped after its done, which would count it again);
    observations are never stacked.

    Frame accounting: every decision writes ``("next", env_steps_key)``, ``[*B, 1]`` int64,
    the number of environment steps it executed (``H'``, fewer when the chunk stopped at a
    done, 0 for a sub-environment skipped by a partial step); the entry is an observation
    (0 at reset), so a collector stores it with the decision.

    Args:
        executed_chunk_length: ``H'``, the number of rows executed per decision.

    Keyword Args:
        action_key: the base environment's action key (default: its only action key). The
            chunk is read from the same key.
        env_steps_key: where the executed environment steps are written (default
            ``"env_steps"``; ``None``: not written).

    Raises:
        ValueError: ``executed_chunk_length < 1``; at step time, a chunk whose shape is not
            ``[*B, executed_chunk_length, *action_shape]``.
        RuntimeError: at step time, a batched environment that is not batch-locked (the
            partial-step mask needs one).

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> env = TransformedEnv(GymEnv("Pusher-v5"), ChunkedAction(4))
        >>> env.action_spec.shape, env.reward_spec.shape
        (torch.Size([4, 7]), torch.Size([1]))
        >>> env.rollout(3)["next", "env_steps"].squeeze(-1).tolist()
        [4, 4, 4]
    """

    def __init__(
        self,
        executed_chunk_length: int,
        *,
        action_key: NestedKey | None = None,
        env_steps_key: NestedKey | None = ENV_STEPS_KEY,
    ):
        super().__init__(
            dim=1, stack_rewards=False, stack_observations=False, action_key=action_key
        )
        self.executed_chunk_length = executed_chunk_length
        self.env_steps_key = env_steps_key
        # Filled by ``_inv_call`` (the rows before the last one) and consumed by ``_step``
        # (the last row), which TorchRL calls in that order within one ``env.step``.
        self._reward_sum: dict[NestedKey, Tensor] | None = None
        self._active: Tensor | None = None
        self._env_steps: Tensor | None = None

    @property
    def executed_chunk_length(self) -> int:
        """``H'``, the rows executed per decision: an integer ``>= 1``, set before the
        transform joins an environment (whose specs are built from it)."""
        return self._executed_chunk_length

    @executed_chunk_length.setter
    def executed_chunk_length(self, value: int) -> None:
        check_integer("executed_chunk_length", value, 1)
        if _attached(self) and value != self.__dict__.get("_executed_chunk_length"):
            raise ValueError(
                f"executed_chunk_length {value}: this ChunkedAction already belongs to an "
                f"environment whose specs hold {self._executed_chunk_length} rows; build a new "
                "environment (make_chunked_env(env, executed_chunk_length)) instead."
            )
        self.__dict__["_executed_chunk_length"] = value

    # ------------------------------------------------------------------ specs
    def _action_key(self, action_keys: list[NestedKey]) -> NestedKey:
        if self.in_keys_inv:
            return self.in_keys_inv[0]
        if len(action_keys) != 1:
            raise ValueError(
                f"ChunkedAction needs a single action key, the environment has {action_keys}; "
                f"pass action_key=... to choose the one that is chunked."
            )
        return action_keys[0]

    def transform_input_spec(self, input_spec: Composite) -> Composite:
        action_spec = input_spec["full_action_spec"]
        action_key = self._action_key(list(action_spec.keys(True, True)))
        batch_dims = input_spec.ndim
        leaf = action_spec[action_key].unsqueeze(batch_dims)
        shape = list(leaf.shape)
        shape[batch_dims] = self.executed_chunk_length
        action_spec[action_key] = leaf.expand(shape)
        input_spec["full_action_spec"] = action_spec
        return input_spec

    def _transform_observation_spec(self, observation_spec: Composite, ndim: int) -> Composite:
        # Observations are never stacked (MultiAction's stack_observations=False).
        if self.env_steps_key is not None:
            observation_spec[self.env_steps_key] = Bounded(
                low=0,
                high=self.executed_chunk_length,
                shape=(*observation_spec.shape, 1),
                dtype=torch.int64,
                device=observation_spec.device,
            )
        return observation_spec

    def _reset(
        self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase
    ) -> TensorDictBase:
        tensordict_reset = super()._reset(tensordict, tensordict_reset)
        if self.env_steps_key is not None:
            shape = (*tensordict_reset.batch_size, 1)
            zeros = torch.zeros(shape, dtype=torch.int64, device=tensordict_reset.device)
            tensordict_reset.set(self.env_steps_key, zeros)
        return tensordict_reset

    def _transform_reward_spec(self, reward_spec: TensorSpec, ndim: int) -> TensorSpec:
        # A sum of k in 1..H' rewards in [low, high] lies in [min(low, H' low), max(high, H' high)].
        for key in list(reward_spec.keys(True, True)):
            leaf = reward_spec[key]
            if isinstance(leaf, Bounded):
                low, high = leaf.space.low, leaf.space.high
                reward_spec[key] = Bounded(
                    low=torch.minimum(low, low * self.executed_chunk_length),
                    high=torch.maximum(high, high * self.executed_chunk_length),
                    shape=leaf.shape,
                    dtype=leaf.dtype,
                    device=leaf.device,
                )
        return reward_spec

    # ------------------------------------------------------------------ stepping
    @staticmethod
    def _done(parent: EnvBase, next_tensordict: TensorDictBase) -> Tensor:
        """``[*B]`` bool: whether any done entry of each sub-environment is set."""
        batch_shape = next_tensordict.batch_size
        done = torch.zeros(batch_shape, dtype=torch.bool, device=next_tensordict.device)
        for key in parent.done_keys:
            value = next_tensordict.get(key)
            done = done | value.reshape(*batch_shape, -1).any(-1)
        return done

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        parent = self.parent
        if parent is None:
            raise RuntimeError("ChunkedAction must be attached to an environment to step it.")
        action_key = self._action_key(list(parent.action_keys))
        batch_shape = tensordict.batch_size
        if batch_shape and not parent.batch_locked:
            raise RuntimeError(
                "ChunkedAction needs a batch-locked environment (GymEnv, SerialEnv, "
                "ParallelEnv, ...) to skip the sub-environments that are done mid-chunk; "
                f"got {type(parent.base_env).__name__} with batch_locked=False."
            )
        chunk = tensordict.get(action_key, None)
        if chunk is None:
            raise KeyError(
                f"ChunkedAction expected the action chunk at {action_key!r}; it is missing "
                f"(keys: {list(tensordict.keys(True, True))})."
            )
        step_shape = parent.full_action_spec[action_key].shape[len(batch_shape) :]
        expected = (*batch_shape, self.executed_chunk_length, *step_shape)
        if tuple(chunk.shape) != expected:
            raise ValueError(
                f"ChunkedAction(executed_chunk_length={self.executed_chunk_length}) got an "
                f"action chunk of shape {tuple(chunk.shape)}, expected {expected} (batch shape, "
                f"executed chunk length, action shape). With FlowSDEPolicy, the policy's "
                f"executed_chunk_length must equal the environment's."
            )
        rows = chunk.unbind(len(batch_shape))

        # Sub-environments that step in this decision (a rollout may already skip some).
        active = tensordict.pop("_step", None)
        if active is None:
            active = torch.ones(batch_shape, dtype=torch.bool, device=chunk.device)
        else:
            active = active.reshape(batch_shape).clone()
        reward_sum = {key: parent.full_reward_spec[key].zero() for key in parent.reward_keys}
        env_steps = torch.zeros((*batch_shape, 1), dtype=torch.int64, device=chunk.device)

        td = tensordict
        for row in rows[:-1]:
            td = td.copy()
            td.set(action_key, row)
            if not active.all():
                td.set("_step", active)
            env_steps = env_steps + active.unsqueeze(-1)
            td = parent.step(td)
            next_td = td.get("next")
            for key, total in reward_sum.items():
                reward = next_td.get(key)
                mask = active.reshape(*batch_shape, *([1] * (reward.ndim - len(batch_shape))))
                reward_sum[key] = total + torch.where(mask, reward, torch.zeros_like(reward))
            active = active & ~self._done(parent, next_td)
            td = parent.step_mdp(td)
            if not active.any():
                break

        td_out = td.copy()
        td_out.set(action_key, rows[-1])
        # When every sub-environment is already done, TorchRL skips the outer step and copies
        # the root entries into "next": the root reward (and step count) must then be the
        # decision's.
        td_out.update(reward_sum)
        if self.env_steps_key is not None:
            td_out.set(self.env_steps_key, env_steps)
        if not active.all():
            td_out.set("_step", active)
        self._reward_sum = reward_sum
        self._active = active
        self._env_steps = env_steps + active.unsqueeze(-1)  # the last row, where active
        return td_out

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if self._reward_sum is None:
            raise RuntimeError(
                "ChunkedAction._step ran without the chunk's first rows: step the environment "
                "with env.step / env.rollout, not the transform alone."
            )
        reward_sum, active, env_steps = self._reward_sum, self._active, self._env_steps
        self._reward_sum = self._active = self._env_steps = None
        batch_shape = next_tensordict.batch_size
        for key, total in reward_sum.items():
            reward = next_tensordict.get(key)
            mask = active.reshape(*batch_shape, *([1] * (reward.ndim - len(batch_shape))))
            next_tensordict.set(key, total + torch.where(mask, reward, torch.zeros_like(reward)))
        if self.env_steps_key is not None:
            next_tensordict.set(self.env_steps_key, env_steps)
        return next_tensordict


def _attached(transform: Transform) -> bool:
    """Whether ``transform`` already belongs to an environment (its specs are built)."""
    return transform.__dict__.get("_container") is not None


def make_chunked_env(
    env: EnvBase, executed_chunk_length: int, *, clamp_actions: bool = False
) -> TransformedEnv:
    """Make ``env`` execute a chunk of ``executed_chunk_length`` actions per step.

    The returned environment's action is ``[*B, executed_chunk_length, D]``; its reward is the
    sum of the executed steps' rewards; ``done`` / ``terminated`` / ``truncated`` and the next
    observation are those of the last executed step (the chunk stops at the first done).
    Observation transforms that must run on every inner step belong to ``env`` itself;
    transforms appended to the returned environment run once per decision. When ``env`` is
    a :class:`~torchrl.envs.TransformedEnv`, the result shares its base environment and holds
    a copy of its transforms followed by :class:`ChunkedAction` (TorchRL's unwrapping of
    nested transformed environments, which keeps ``rand_action`` working).

    Every decision writes ``("next", "env_steps")``, the environment steps it executed (see
    :class:`ChunkedAction`): a collector's frames count decisions, its batch's environment
    steps are ``batch["next", "env_steps"].sum()``.

    Args:
        env: any batch-locked TorchRL environment (batched or not) with a single action key.
        executed_chunk_length: ``H'``, the number of rows executed per decision.

    Keyword Args:
        clamp_actions: clamp every executed row to the bounds of ``env``'s action spec, per
            dimension (:class:`ClampAction`); the stored ``"action"`` stays the policy's.

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> env = make_chunked_env(GymEnv("Pusher-v5"), executed_chunk_length=4)
        >>> env.rollout(3)["action"].shape
        torch.Size([3, 4, 7])
    """
    transform = ChunkedAction(executed_chunk_length)
    if clamp_actions:  # after ChunkedAction: its inverse clamps the chunk before it is split
        transform = Compose(transform, ClampAction())
    return TransformedEnv(env, transform, auto_unwrap=True)


def decision_discount(gamma_step: float, executed_chunk_length: int) -> float:
    """The per-decision discount ``gamma_step ** executed_chunk_length`` (module docstring).

    Examples:
        >>> round(decision_discount(0.99, 4), 6)
        0.960596
    """
    if not 0.0 <= gamma_step <= 1.0:
        raise ValueError(f"gamma_step must be in [0, 1], got {gamma_step}.")
    if executed_chunk_length < 1:
        raise ValueError(f"executed_chunk_length must be >= 1, got {executed_chunk_length}.")
    return float(gamma_step) ** executed_chunk_length
