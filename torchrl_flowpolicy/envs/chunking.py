"""Chunked execution: one policy decision executes a chunk of ``H`` environment steps.

Built on TorchRL's :class:`~torchrl.envs.transforms.MultiAction`, which unbinds the chunk and
steps the base environment once per row, stopping at the first done. :class:`ChunkedAction`
fixes the chunk length in the action spec and turns the stacked per-step rewards into the
decision's reward: the sum of the rewards of the executed steps (MultiAction zero-fills the
skipped remainder of a chunk that hit a done, so they add nothing).

Per-decision discount: a decision spans up to ``H`` environment steps, and its reward is the
undiscounted sum of those steps' rewards. A value estimator running at the decision level
(GAE on the collected macro-steps) should use ``gamma_decision = gamma_step ** H`` to keep
the effective horizon of a per-step ``gamma_step``; :func:`decision_discount` computes it.
Within a chunk the rewards are not discounted (the usual SMDP approximation for short chunks).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.transforms import MultiAction

__all__ = ["ChunkedAction", "make_chunked_env", "decision_discount"]


class ChunkedAction(MultiAction):
    """TorchRL's :class:`~torchrl.envs.transforms.MultiAction` with a fixed chunk length and
    the decision's reward.

    MultiAction leaves the chunk dimension of the action spec dynamic (``-1``); fixing it to
    ``chunk_length`` lets specs, random actions, fake tensordicts and storages know the shape.
    With ``sum_rewards=True`` the stacked per-step rewards are summed into the decision's
    reward, with the base environment's reward spec; MultiAction zero-fills the slots skipped
    after a done, so they add nothing.

    Args:
        chunk_length: the number of rows executed per decision.

    Keyword Args:
        sum_rewards: reduce the stacked rewards to their sum (default).
        **kwargs: forwarded to :class:`~torchrl.envs.transforms.MultiAction`
            (``stack_rewards`` defaults to ``True`` here).
    """

    def __init__(self, chunk_length: int, *, sum_rewards: bool = True, **kwargs):
        if chunk_length < 1:
            raise ValueError(f"chunk_length must be >= 1, got {chunk_length}.")
        kwargs.setdefault("stack_rewards", True)
        super().__init__(**kwargs)
        self.chunk_length = chunk_length
        self.sum_rewards = sum_rewards

    def transform_input_spec(self, input_spec: Composite) -> Composite:
        action_spec = input_spec["full_action_spec"]
        action_keys = self.in_keys_inv or list(action_spec.keys(True, True))
        chunk_keys = self.out_keys_inv or action_keys
        one_step = {key: action_spec[key] for key in action_keys}
        ndim = input_spec.ndim
        input_spec = super().transform_input_spec(input_spec)
        for action_key, chunk_key in zip(action_keys, chunk_keys, strict=True):
            leaf = one_step[action_key]
            for _ in range(self.dim):
                leaf = leaf.unsqueeze(ndim)
            shape = list(leaf.shape)
            shape[ndim + self.dim - 1] = self.chunk_length
            input_spec["full_action_spec"][chunk_key] = leaf.expand(shape)
        return input_spec

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        # MultiAction stacks the executed steps' rewards (zero-filling the slots skipped after
        # a done); the decision's reward is their sum. Called on both of MultiAction's paths.
        next_tensordict = super()._step(tensordict, next_tensordict)
        if self.stack_rewards and self.sum_rewards:
            ndim = next_tensordict.ndim
            for key in self.parent.reward_keys:
                reward = next_tensordict.get(key)
                next_tensordict.set(key, reward.sum(ndim + self.dim - 1))
        return next_tensordict

    def _transform_reward_spec(self, reward_spec, ndim):
        if self.sum_rewards:
            return reward_spec
        return super()._transform_reward_spec(reward_spec, ndim)


def make_chunked_env(env: EnvBase, chunk_length: int) -> TransformedEnv:
    """Make ``env`` execute a chunk of ``chunk_length`` actions per step.

    The returned environment's action is ``[*B, chunk_length, D]``; its reward is the sum of
    the executed steps' rewards; ``done`` / ``terminated`` / ``truncated`` are those of the
    last executed step (MultiAction stops at the first done). Observation transforms that
    must run on every inner step belong to ``env`` itself; transforms appended to the
    returned environment run once per decision.

    Args:
        env: any TorchRL environment (batched or not) with a single action key.
        chunk_length: ``H'``, the number of rows executed per decision.

    Example:
        >>> from torchrl.envs import GymEnv
        >>> env = make_chunked_env(GymEnv("Pusher-v5"), chunk_length=4)  # doctest: +SKIP
        >>> env.rollout(3)["action"].shape  # doctest: +SKIP
        torch.Size([3, 4, 7])
    """
    return TransformedEnv(env, ChunkedAction(chunk_length))


def decision_discount(gamma_step: float, chunk_length: int) -> float:
    """The per-decision discount ``gamma_step ** chunk_length`` (see the module docstring)."""
    return float(torch.tensor(gamma_step, dtype=torch.float64) ** chunk_length)
