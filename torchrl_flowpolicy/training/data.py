"""Demonstrations to chunk-prediction training data."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

__all__ = ["make_chunk_dataset"]


def make_chunk_dataset(
    observations: Tensor, actions: Tensor, episode_ids: Tensor, chunk_length: int
) -> TensorDict:
    """One training sample per demonstration step: its observation and the next ``H`` actions.

    Args:
        observations: ``[T, O]``, the steps of all episodes, concatenated in time order.
        actions: ``[T, D]``, the action taken at each step.
        episode_ids: ``[T]``, the episode of each step (steps of an episode are contiguous).
        chunk_length: ``H``.

    Returns:
        A TensorDict with batch ``[T]``: ``"observation"`` ``[T, O]``, ``"action"``
        ``[T, H, D]`` (rows past the episode's end are zero) and ``"action_row_mask"``
        ``[T, H]`` (``False`` on those padding rows), the keys
        :class:`~torchrl_flowpolicy.objectives.FlowMatchingLoss` reads.

    Examples:
        >>> data = make_chunk_dataset(
        ...     torch.zeros(3, 2), torch.arange(3.0)[:, None], torch.tensor([0, 0, 1]), 2
        ... )
        >>> data["action"][..., 0], data["action_row_mask"]
        (tensor([[0., 1.],
                [1., 0.],
                [2., 0.]]), tensor([[ True,  True],
                [ True, False],
                [ True, False]]))
    """
    num_steps = observations.shape[0]
    if actions.shape[0] != num_steps or episode_ids.shape[0] != num_steps:
        raise ValueError(
            f"observations ({observations.shape[0]}), actions ({actions.shape[0]}) and "
            f"episode_ids ({episode_ids.shape[0]}) must have the same number of steps."
        )
    if chunk_length < 1:
        raise ValueError(f"chunk_length must be >= 1, got {chunk_length}.")
    index = torch.arange(num_steps)[:, None] + torch.arange(chunk_length)
    in_range = index < num_steps
    index = index.clamp_max(num_steps - 1)
    valid = in_range & (episode_ids[index] == episode_ids[:, None])
    chunks = torch.where(valid[..., None], actions[index], torch.zeros_like(actions[index]))
    return TensorDict(
        {"observation": observations, "action": chunks, "action_row_mask": valid},
        batch_size=[num_steps],
    )
