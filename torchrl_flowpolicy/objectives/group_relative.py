"""Group-relative advantages (GRPO): each episode's return against those of its group.

Critic-free fine-tuning of flow policies (Flow-GRPO, Liu et al., 2025; pi-RL, Chen et al.,
2025; after GRPO, Shao et al., 2024) runs ``G`` episodes from the same initial state (a
*group*) and scores episode ``i`` of group ``g`` by

``A_i = (R_i - mean_g R) / (std_g R + eps)``,

with ``std_g`` the standard deviation of the group's returns with Bessel's correction (as
``torch.std`` and TorchRL's ``MCAdvantage`` compute it). ``A_i`` is then broadcast over every
decision of the episode, and :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`
broadcasts each decision's advantage over its stochastic denoising steps, so no critic is
needed.

A group whose returns are all equal (every rollout failed, or every one succeeded) carries no
learning signal: its advantages are exactly 0, by rule. The formula alone would not give 0:
with ``eps = 0`` it is 0 / 0, and rounding leaves the computed mean slightly off the common
value (three float64 returns of 0.1: 1.4e-17 off, a std of 1.7e-17, advantages of -0.82 with
``eps = 0``; seven float32 returns of 0.3 averaged in float32: 0.03 with ``eps = 1e-6``).
Such groups stay in the batch (they still count in the loss's mean and feed its KL and
self-imitation terms); dropping them (DAPO's dynamic sampling) is left to the caller.

This module holds the pure tensor function (:func:`group_relative_advantage`), the episode
boundary of a collector batch (:func:`first_episode_mask`) and the thin TensorDict module
that maps a ``[*B, T]`` batch's keys to them (:class:`GroupRelativeAdvantage`).

Why not TorchRL's ``torchrl.objectives.llm.MCAdvantage``: with ``trajectory_return="sum"``
it computes the same advantage (the tests check that they agree), but it is a replay-buffer
transform made for complete trajectories: it raises on a row that does not end with a
``done``, which every ``[num_envs, T]`` collector batch holds once an environment ends early
and is reset by the collector (e.g. robosuite Lift, whose episodes end at the first
success), it keeps incomplete groups in queues between writes, and it returns the
trajectories flattened and regrouped. :class:`GroupRelativeAdvantage` reads the batch as
the collector wrote it, scores each row's *first* episode, zeroes the decisions after it and
marks them in ``episode_mask``, keeping the batch's shape.

Shape glossary: ``B`` rows (environments), ``T`` decisions per row, ``N`` episodes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor

__all__ = ["GroupRelativeAdvantage", "first_episode_mask", "group_relative_advantage"]


def group_relative_advantage(returns: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """``(R_i - mean_g) / (std_g + eps)`` per episode, 0 in a group of equal returns.

    Groups are the distinct values of ``group_ids`` (any integers, in any order, of any
    size of at least 2); ``std_g`` has Bessel's correction. Computed in float64, returned in
    ``returns``' dtype when it is floating, else in torch's default floating dtype (integer
    or boolean rewards, e.g. successes, give fractional advantages). One batched pass: no
    Python loop over the groups.

    Args:
        returns: ``[*E]`` episode returns.
        group_ids: ``[*E]`` integer group of each episode.

    Keyword Args:
        eps: added to each group's std: a finite number ``>= 0``.

    Returns:
        ``[*E]`` advantages, floating.

    Raises:
        ValueError: mismatched shapes, non-integer group ids, a non-finite return, a group
            with a single episode (its std is undefined), an ``eps`` that is negative or not
            finite.

    Examples:
        >>> returns = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
        >>> group_relative_advantage(returns, torch.tensor([0, 0, 1, 1, 2, 2]))
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000,  0.0000,  0.0000])
    """
    if returns.shape != group_ids.shape:
        raise ValueError(
            f"returns {tuple(returns.shape)} and group_ids {tuple(group_ids.shape)} must have "
            f"the same shape: one group id per episode."
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got {group_ids.dtype}.")
    check_eps(eps)
    if not torch.isfinite(returns).all():
        bad = int((~torch.isfinite(returns)).sum())
        raise ValueError(f"{bad} of {returns.numel()} episode returns are not finite.")
    flat_returns = returns.reshape(-1).to(torch.float64)
    _, group, counts = torch.unique(group_ids.reshape(-1), return_inverse=True, return_counts=True)
    if (counts < 2).any():
        raise ValueError(
            f"{int((counts < 2).sum())} group(s) hold a single episode: a group needs at least "
            f"2 episodes (its std is undefined otherwise)."
        )
    num_groups = counts.numel()
    zeros = flat_returns.new_zeros(num_groups)
    mean = zeros.index_add(0, group, flat_returns) / counts
    centered = flat_returns - mean[group]
    std = (zeros.index_add(0, group, centered.square()) / (counts - 1)).sqrt()
    highest = zeros.scatter_reduce(0, group, flat_returns, "amax", include_self=False)
    lowest = zeros.scatter_reduce(0, group, flat_returns, "amin", include_self=False)
    advantage = centered / (std[group] + eps)
    advantage = torch.where((highest == lowest)[group], torch.zeros_like(advantage), advantage)
    dtype = returns.dtype if returns.is_floating_point() else torch.get_default_dtype()
    return advantage.to(dtype).reshape(returns.shape)


def check_eps(eps: object) -> None:
    """Refuse an ``eps`` that is not a finite real number ``>= 0`` (NaN would pass ``eps <
    0`` and make every advantage NaN), naming it."""
    if (
        isinstance(eps, bool)
        or not isinstance(eps, numbers.Real)
        or not (math.isfinite(eps) and eps >= 0)
    ):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}.")


def first_episode_mask(done: Tensor) -> Tensor:
    """``True`` at the decisions of each row's first episode: up to and including its first
    ``done``.

    Args:
        done: ``[*B, T]`` done flags, time last (a row without a ``done`` is all ``True``).

    Returns:
        ``[*B, T]`` booleans.

    Examples:
        >>> first_episode_mask(torch.tensor([[False, True, False], [False, False, True]]))
        tensor([[ True,  True, False],
                [ True,  True,  True]])
    """
    if done.ndim < 1:
        raise ValueError(f"done must be [*B, T] (time last), got shape {tuple(done.shape)}.")
    done = done.bool()
    dones_before = done.long().cumsum(-1) - done.long()
    return dones_before == 0


class GroupRelativeAdvantage(TensorDictModuleBase):
    """The group-relative advantage of each row's first episode in a ``[*B, T]`` batch.

    Reads a batch as a TorchRL collector writes it (``[num_envs, T]`` decisions, time last):
    the rewards, the done flags and the group id of each row (constant along the row, e.g.
    ``env_index // group_size`` for groups of consecutive environments reset with the same
    seed). Each row's first episode (:func:`first_episode_mask`) must end within the batch;
    its return ``R`` is the undiscounted sum of its rewards; :func:`group_relative_advantage`
    scores it against the other rows of its group. Writes

    - ``advantage`` ``[*B, T, 1]``: the episode's advantage at each of its decisions, 0 after;
    - ``episode_mask`` ``[*B, T]``: ``True`` at the decisions of the first episode; the
      decisions after it (a new episode the collector started) must not reach the loss:
      ``batch[batch["episode_mask"]]`` keeps the others;
    - ``episode_return`` ``[*B, T, 1]``: ``R`` at each decision of the episode, 0 after.

    Group-relative PPO (Flow-GRPO, Liu et al., 2025; pi-RL, Chen et al., 2025) is this module
    followed by a critic-free :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`
    (no ``critic_network``, ``normalize_advantage=False``: the advantage is normalised per
    group already).

    Keyword Args:
        eps: added to each group's std (:func:`group_relative_advantage`).

    Keys (``set_keys``): ``reward`` (default ``("next", "reward")``), ``done``
    (``("next", "done")``), ``group_id`` (``"group_id"``), ``advantage`` (``"advantage"``),
    ``episode_mask`` (``"episode_mask"``), ``episode_return`` (``"episode_return"``).

    Examples:
        >>> from tensordict import TensorDict
        >>> reward = torch.tensor([[0.0, 1.0, 5.0], [0.0, 0.0, 0.0]]).unsqueeze(-1)
        >>> done = torch.tensor([[False, True, False], [False, False, True]]).unsqueeze(-1)
        >>> batch = TensorDict(
        ...     {
        ...         "group_id": torch.zeros(2, 3, dtype=torch.long),
        ...         ("next", "reward"): reward,  # row 0: return 1 (its episode ends at t = 1)
        ...         ("next", "done"): done,  # row 1: return 0
        ...     },
        ...     batch_size=[2, 3],
        ... )
        >>> batch = GroupRelativeAdvantage()(batch)
        >>> batch["advantage"].squeeze(-1)
        tensor([[ 0.7071,  0.7071,  0.0000],
                [-0.7071, -0.7071, -0.7071]])
        >>> batch[batch["episode_mask"]].batch_size
        torch.Size([5])
    """

    @dataclass
    class _AcceptedKeys:
        """The entries read (``reward``, ``done``, ``group_id``) and written (``advantage``,
        ``episode_mask``, ``episode_return``); renamed with ``set_keys``."""

        reward: NestedKey = ("next", "reward")
        done: NestedKey = ("next", "done")
        group_id: NestedKey = "group_id"
        advantage: NestedKey = "advantage"
        episode_mask: NestedKey = "episode_mask"
        episode_return: NestedKey = "episode_return"

    default_keys = _AcceptedKeys
    _READ = ("reward", "done", "group_id")
    _WRITTEN = ("advantage", "episode_mask", "episode_return")

    def __init__(self, *, eps: float = 1e-6):
        super().__init__()
        check_eps(eps)
        self.eps = float(eps)
        self.tensor_keys = self._AcceptedKeys()
        self._set_in_out_keys()

    def _set_in_out_keys(self) -> None:
        self.in_keys = [getattr(self.tensor_keys, name) for name in self._READ]
        self.out_keys = [getattr(self.tensor_keys, name) for name in self._WRITTEN]

    def set_keys(self, **kwargs: NestedKey) -> None:
        """Rename the entries read or written (see :class:`GroupRelativeAdvantage._AcceptedKeys`).

        Examples:
            >>> module = GroupRelativeAdvantage()
            >>> module.set_keys(group_id=("collector", "group"))
            >>> module.in_keys
            [('next', 'reward'), ('next', 'done'), ('collector', 'group')]
        """
        fields = [item.name for item in dataclasses.fields(self.tensor_keys)]
        for name, key in kwargs.items():
            if name not in fields:
                raise ValueError(
                    f"unknown key {name!r}; GroupRelativeAdvantage's keys are {fields}."
                )
            setattr(
                self.tensor_keys, name, getattr(self.default_keys(), name) if key is None else key
            )
        self._set_in_out_keys()

    def _per_decision(self, tensordict: TensorDictBase, name: str) -> Tensor:
        """The ``[*B, T]`` entry ``name`` (a trailing singleton dimension dropped)."""
        key = getattr(self.tensor_keys, name)
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"GroupRelativeAdvantage needs {key!r} ({name}); set_keys({name}=...) renames it."
            )
        if value.shape == (*tensordict.batch_size, 1):
            value = value.squeeze(-1)
        if value.shape != tensordict.batch_size:
            raise ValueError(
                f"{key!r} has shape {tuple(value.shape)}; expected the batch shape "
                f"{tuple(tensordict.batch_size)}, optionally followed by 1."
            )
        return value

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.batch_dims < 2:
            raise ValueError(
                f"GroupRelativeAdvantage needs a [*B, T] batch of rows of decisions (time last, "
                f"as a collector writes it); got batch shape {tuple(tensordict.batch_size)}."
            )
        reward = self._per_decision(tensordict, "reward")
        done = self._per_decision(tensordict, "done")
        group_id = self._per_decision(tensordict, "group_id")
        row_group = group_id[..., 0]
        if (group_id != row_group.unsqueeze(-1)).any():
            raise ValueError(
                f"{self.tensor_keys.group_id!r} changes along a row: a row is one environment, "
                f"whose decisions all belong to its group."
            )
        mask = first_episode_mask(done)
        unfinished = ~done.bool().any(-1)
        if unfinished.any():
            raise ValueError(
                f"{int(unfinished.sum())} of {unfinished.numel()} rows hold no done within "
                f"their {done.shape[-1]} decisions: the first episode of every row must end "
                f"within the batch (collect at least one full episode per environment)."
            )
        reward = torch.where(mask, reward, torch.zeros_like(reward))
        returns = reward.sum(-1)
        advantage = group_relative_advantage(returns, row_group, eps=self.eps)
        zero = torch.zeros_like(reward)
        tensordict.set(
            self.tensor_keys.advantage,
            torch.where(mask, advantage.unsqueeze(-1), zero).unsqueeze(-1),
        )
        tensordict.set(self.tensor_keys.episode_mask, mask)
        tensordict.set(
            self.tensor_keys.episode_return,
            torch.where(mask, returns.unsqueeze(-1), zero).unsqueeze(-1),
        )
        return tensordict
