"""Deterministic evaluation of a policy on a batch of seeded episodes."""

from __future__ import annotations

import time

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType, set_exploration_type

__all__ = ["evaluate_policy", "episode_outcomes"]


def episode_outcomes(
    rollout: TensorDictBase, success_key: NestedKey = "success"
) -> dict[str, torch.Tensor]:
    """Per-episode return and success of a rollout ``[num_envs, T]``.

    Each environment's episode ends at its first ``("next", "done")``; the return sums the
    rewards up to and including that step; success is ``("next", success_key)`` at that step.
    An environment that never finished counts its whole rollout and its last step.

    Returns:
        ``{"return": [num_envs], "success": [num_envs] bool, "length": [num_envs]}``.
    """
    done = rollout.get(("next", "done")).reshape(rollout.shape[0], rollout.shape[1])
    num_steps = done.shape[1]
    steps = torch.arange(num_steps, device=done.device).expand_as(done)
    last = torch.where(done, steps, torch.full_like(steps, num_steps - 1)).min(dim=1).values
    reward = rollout.get(("next", "reward")).reshape(done.shape)
    within = steps <= last[:, None]
    episode_return = (reward * within).sum(1)
    rows = torch.arange(done.shape[0], device=done.device)
    success = rollout.get(("next", success_key)).reshape(done.shape)[rows, last].bool()
    return {"return": episode_return, "success": success, "length": last + 1}


@torch.no_grad()
def evaluate_policy(
    policy: TensorDictModuleBase,
    env: EnvBase,
    *,
    max_decisions: int,
    seed: int,
    exploration_type: ExplorationType = ExplorationType.DETERMINISTIC,
    success_key: NestedKey = "success",
) -> dict[str, float]:
    """Run one episode in each of ``env``'s batched environments and summarise them.

    ``env`` is seeded with ``seed`` before its reset and torch's global RNG with ``seed``
    inside a forked RNG state, so the same ``seed`` gives the same initial states and the
    same policy noise (a flow policy's ``x_0``): use a fixed evaluation seed to compare
    checkpoints. The caller's random stream is left untouched. Under the default
    DETERMINISTIC exploration a :class:`~torchrl_flowpolicy.FlowSDEPolicy` runs its ODE with
    ``eval_num_steps``.

    Args:
        policy: the policy to evaluate.
        env: a batched environment (``env.batch_size = [num_episodes]``) writing
            ``("next", success_key)``.

    Keyword Args:
        max_decisions: the rollout length in decisions (macro-steps).
        seed: the evaluation seed.
        exploration_type: DETERMINISTIC (default) or RANDOM (the rollout policy).
        success_key: the success entry.

    Returns:
        ``success_rate``, ``mean_return``, ``num_episodes`` and ``seconds``.
    """
    start = time.perf_counter()
    env.set_seed(seed)
    # The policy's own randomness (a flow policy's initial noise) is seeded too, in a forked
    # RNG so that evaluating does not change the caller's random stream.
    with torch.random.fork_rng(devices=[]), set_exploration_type(exploration_type):
        torch.manual_seed(seed)
        rollout = env.rollout(
            max_decisions, policy, break_when_any_done=False, break_when_all_done=True
        )
    if rollout.ndim == 1:
        rollout = rollout.unsqueeze(0)
    outcomes = episode_outcomes(rollout, success_key)
    return {
        "success_rate": outcomes["success"].float().mean().item(),
        "mean_return": outcomes["return"].float().mean().item(),
        "num_episodes": int(outcomes["success"].numel()),
        "seconds": time.perf_counter() - start,
    }
