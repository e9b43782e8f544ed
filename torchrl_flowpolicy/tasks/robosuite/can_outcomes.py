"""Why a PickPlaceCan episode failed, read from its observations alone.

A success rate says how often a policy puts the can in its compartment; when it stops short of
the target, the failures' kinds say what to change (the grasp, the carry, the release, the
horizon). :func:`classify_can_episodes` sorts each episode of a rollout into one of
:data:`CAN_OUTCOMES`, from the can's and the grip site's world positions in the observation
(:data:`~torchrl_flowpolicy.tasks.robosuite.layout.OBSERVATION_SLICES`), checked in this order:

- ``"success"``: the task's own ``_check_success()`` at the episode's end;
- ``"never_lifted"``: the can's centre never rose ``lift_height`` (3 cm) above where it stood
  at the reset: the grasp failed or never happened (a can knocked over counts here);
- ``"not_released"``: at the end the grip site is still within ``release_distance`` of the
  can's centre (robosuite's own "let go" threshold, 0.042 m): carried, or placed and held,
  until the horizon ran out;
- ``"fell_over"``: let go, the can lying (its axis more than 45 degrees from vertical);
- ``"released_upright"``: let go, standing, outside its compartment (dropped or misplaced).

Only the decisions' observations are read (every ``H'`` env steps on the chunked
environment), so a lift that rose and fell between two decisions is missed: the kinds are a
diagnosis, the success flag is the task's.

Example:
    >>> import torch
    >>> from torchrl_flowpolicy.tasks.robosuite.can_outcomes import CAN_OUTCOMES, classify_can_episodes
    >>> observations = torch.zeros(1, 3, 64)
    >>> observations[..., 7:10] = torch.tensor([0.1, -0.25, 0.86])  # the can, standing
    >>> observations[..., 13] = 1.0  # its quaternion (x, y, z, w): upright
    >>> kind = classify_can_episodes(observations, torch.tensor([1]), torch.tensor([False]))
    >>> CAN_OUTCOMES[kind.item()]
    'never_lifted'
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase
from torch import Tensor

from torchrl_flowpolicy.tasks.robosuite.layout import OBSERVATION_SLICES

__all__ = [
    "CAN_OUTCOMES",
    "CAN_PLACEMENT_RANGE",
    "can_rollout_outcomes",
    "classify_can_episodes",
    "distance_to_placement_edge",
]

#: The kinds of episode, in the order they are checked.
CAN_OUTCOMES: tuple[str, ...] = (
    "success",
    "never_lifted",
    "not_released",
    "fell_over",
    "released_upright",
)

#: The range the can's centre is placed in at the reset, ``((x_low, x_high), (y_low, y_high))``
#: in m (:mod:`~torchrl_flowpolicy.tasks.robosuite.layout`).
CAN_PLACEMENT_RANGE: tuple[tuple[float, float], tuple[float, float]] = (
    (-0.02, 0.22),
    (-0.42, -0.08),
)

_SLICES = OBSERVATION_SLICES["PickPlaceCan"]


def distance_to_placement_edge(can_xy: Tensor) -> Tensor:
    """How far the can's centre ``[..., 2]`` (x, y in m) lies inside the edge of
    :data:`CAN_PLACEMENT_RANGE`: the smallest of its four distances to the range's sides
    (negative outside). The fine-tuned policy's remaining failures start near this edge
    (docs/robosuite.md).

    Example:
        >>> import torch
        >>> distance_to_placement_edge(torch.tensor([[0.10, -0.25], [0.21, -0.25]]))
        tensor([0.1200, 0.0100])
    """
    (x_low, x_high), (y_low, y_high) = CAN_PLACEMENT_RANGE
    x, y = can_xy.unbind(-1)
    sides = torch.stack([x - x_low, x_high - x, y - y_low, y_high - y], dim=-1)
    return sides.min(dim=-1).values


def classify_can_episodes(
    observations: Tensor,
    last: Tensor,
    success: Tensor,
    *,
    lift_height: float = 0.03,
    release_distance: float = 0.042,
    max_tilt_degrees: float = 45.0,
) -> Tensor:
    """The kind of each episode, as an index into :data:`CAN_OUTCOMES`.

    Args:
        observations: ``[N, T + 1, 64]`` flat PickPlaceCan observations, the reset's first
            and then the one after each decision (a rollout's first ``"observation"``, then
            its ``("next", "observation")``: :func:`can_rollout_outcomes`).
        last: ``[N]`` the index of each episode's final decision (its observation is
            ``observations[:, last + 1]``); later entries (another episode) are ignored.
        success: ``[N]`` the task's success flag at the episode's end.

    Keyword Args:
        lift_height: how far the can's centre must rise above its reset height (m) to count
            as lifted.
        release_distance: the grip site within this distance of the can's centre (m) at the
            end: not let go.
        max_tilt_degrees: the can's axis further than this from vertical: fallen over.

    Returns:
        ``[N]`` int64 indices into :data:`CAN_OUTCOMES`.
    """
    if observations.ndim != 3 or observations.shape[-1] != 64:
        raise ValueError(
            f"observations must be [N, T + 1, 64] PickPlaceCan observations, got "
            f"{tuple(observations.shape)}."
        )
    num_episodes, num_observations = observations.shape[:2]
    if last.shape != (num_episodes,) or success.shape != (num_episodes,):
        raise ValueError(
            f"last and success must be [{num_episodes}], got {tuple(last.shape)} and "
            f"{tuple(success.shape)}."
        )
    if bool((last < 0).any()) or bool((last + 1 >= num_observations).any()):
        raise ValueError(f"last must lie in [0, {num_observations - 2}], got {last.tolist()}.")
    can = observations[..., _SLICES["can_pos"]]
    rows = torch.arange(num_episodes, device=observations.device)
    final = observations[rows, last + 1]
    within = torch.arange(num_observations, device=observations.device) <= (last + 1)[:, None]
    height = torch.where(within, can[..., 2], torch.full_like(can[..., 2], -math.inf))
    lifted = height.max(dim=1).values - can[:, 0, 2] > lift_height
    grip_to_can = (final[:, _SLICES["eef_pos"]] - final[:, _SLICES["can_pos"]]).norm(dim=-1)
    released = grip_to_can > release_distance
    # The can's axis is its local z; its world z component is 1 - 2 (x^2 + y^2).
    quaternion = final[:, _SLICES["can_quat"]]
    axis_z = 1 - 2 * (quaternion[:, 0] ** 2 + quaternion[:, 1] ** 2)
    fallen = axis_z < math.cos(math.radians(max_tilt_degrees))
    kind = torch.full(
        (num_episodes,),
        CAN_OUTCOMES.index("released_upright"),
        dtype=torch.long,
        device=observations.device,
    )
    kind[fallen] = CAN_OUTCOMES.index("fell_over")
    kind[~released] = CAN_OUTCOMES.index("not_released")
    kind[~lifted] = CAN_OUTCOMES.index("never_lifted")
    kind[success.bool()] = CAN_OUTCOMES.index("success")
    return kind


def can_rollout_outcomes(rollout: TensorDictBase, outcomes: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{"kind": [N]}``: :func:`classify_can_episodes` of a rollout ``[N, T]`` of the chunked
    PickPlaceCan environment, given its
    :func:`~torchrl_flowpolicy.training.evaluation.episode_outcomes` (pass it as ``details``
    to :func:`~torchrl_flowpolicy.training.evaluation.evaluate_episodes`; the ``"can"``
    task's registry entry does, as its ``episode_kinds``).

    The episode's observations are the reset's and each decision's ``("next",
    "observation")``: after an episode ends the rollout's ``"observation"`` is the next
    episode's reset, its ``("next", "observation")`` still the episode's last.
    """
    after = rollout.get(("next", "observation"))
    observations = torch.cat([rollout.get("observation")[:, :1], after], dim=1)
    kind = classify_can_episodes(observations, outcomes["length"] - 1, outcomes["success"])
    return {"kind": kind}
