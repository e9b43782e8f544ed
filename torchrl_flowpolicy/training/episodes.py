"""Episode views of a collected batch ``[num_envs, T]``: which decisions led to a success,
and the group-relative episodes of a GRPO batch with their diagnostics.

A PPO iteration prepares its batch with these before the loss:

* :func:`episode_success_flags` flags the decisions of successful episodes (what the
  self-imitation term of :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`
  imitates);
* :func:`group_relative_episodes` keeps each environment's first episode with its
  group-relative advantage (:class:`~torchrl_flowpolicy.objectives.GroupRelativeAdvantage`,
  groups of ``group_size`` consecutive environments), and :func:`group_statistics` reports
  on the groups;
* :func:`batch_statistics`: the success and the chunk reward a training run logs.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> done = torch.tensor([[False, True], [False, True]]).unsqueeze(-1)
    >>> success = torch.tensor([[False, True], [False, False]]).unsqueeze(-1)
    >>> batch = TensorDict({"next": {"done": done, "success": success}}, batch_size=[2, 2])
    >>> episode_success_flags(batch).tolist()
    [[True, True], [False, False]]
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from torchrl_flowpolicy.objectives import GroupRelativeAdvantage

__all__ = [
    "episode_success_flags",
    "group_relative_episodes",
    "group_statistics",
    "batch_statistics",
]


def episode_success_flags(batch: TensorDictBase) -> torch.Tensor:
    """Flag every decision of an episode that ended in success, ``[num_envs, T]`` (episodes
    that have not ended within the batch are not flagged)."""
    done = batch["next", "done"].squeeze(-1)
    success = batch["next", "success"].squeeze(-1) & done
    flags = torch.zeros_like(done)
    carry = torch.zeros_like(done[:, 0])
    for step in reversed(range(done.shape[1])):
        carry = torch.where(done[:, step], success[:, step], carry)
        flags[:, step] = carry
    return flags


def group_relative_episodes(batch: TensorDictBase, group_size: int) -> TensorDictBase:
    """The decisions of each environment's first episode, ``[M]``, with its group-relative
    advantage.

    Environment ``i`` of the ``[num_envs, T]`` batch belongs to group ``i // group_size``
    (``"group_id"``, stamped on every decision); :class:`GroupRelativeAdvantage` scores the
    return of its first episode (every environment started one at the batch's reset, and
    ``T`` covers a whole episode) against its group's; the decisions after an early end (the
    next episode, which the collector started) are dropped.
    """
    environment = torch.arange(batch.shape[0], device=batch.device)
    batch["group_id"] = (environment // group_size).unsqueeze(-1).expand(batch.shape)
    batch = GroupRelativeAdvantage()(batch)
    return batch[batch["episode_mask"]]


def group_statistics(
    episodes: TensorDictBase, group_size: int, collected_decisions: int
) -> dict[str, float]:
    """Diagnostics of :func:`group_relative_episodes`' output (whose episodes end in the
    order of their environments): the mean episode return, the mean within-group std, the
    share of groups without spread (their advantage is 0) and of the decisions kept."""
    done = episodes["next", "done"].squeeze(-1)
    returns = episodes["episode_return"][done].reshape(-1, group_size)
    no_spread = returns.amax(-1) == returns.amin(-1)
    return {
        "grpo/episode_return": returns.mean().item(),
        "grpo/group_return_std": returns.std(-1).mean().item(),
        "grpo/zero_std_groups": no_spread.float().mean().item(),
        "grpo/kept_decisions": episodes.numel() / collected_decisions,
    }


def batch_statistics(batch: TensorDictBase) -> dict[str, float]:
    """A collected batch's training statistics: ``"train/episode_success"``, the success
    rate of the episodes that ended in it (absent when none did), and
    ``"train/chunk_reward"``, the mean reward per decision."""
    done = batch["next", "done"].squeeze(-1)
    statistics = {}
    if done.any():
        success = batch["next", "success"].squeeze(-1)[done].float()
        statistics["train/episode_success"] = success.mean().item()
    statistics["train/chunk_reward"] = batch["next", "reward"].mean().item()
    return statistics
