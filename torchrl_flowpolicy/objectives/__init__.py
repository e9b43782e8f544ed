"""Losses: denoising-step PPO and supervised flow matching; group-relative advantages."""

from torchrl_flowpolicy.objectives.flow_matching import (
    FlowMatchingLoss,
    flow_matching_per_sample,
    self_imitation_error,
)
from torchrl_flowpolicy.objectives.group_relative import (
    GroupRelativeAdvantage,
    first_episode_mask,
    group_relative_advantage,
)
from torchrl_flowpolicy.objectives.ppo import DenoisingClipPPOLoss

__all__ = [
    "DenoisingClipPPOLoss",
    "FlowMatchingLoss",
    "GroupRelativeAdvantage",
    "first_episode_mask",
    "flow_matching_per_sample",
    "group_relative_advantage",
    "self_imitation_error",
]
