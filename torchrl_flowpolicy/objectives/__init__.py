"""Losses: denoising-step PPO and supervised flow matching."""

from torchrl_flowpolicy.objectives.flow_matching import (
    FlowMatchingLoss,
    flow_matching_per_sample,
    self_imitation_error,
)
from torchrl_flowpolicy.objectives.ppo import DenoisingClipPPOLoss

__all__ = [
    "DenoisingClipPPOLoss",
    "FlowMatchingLoss",
    "flow_matching_per_sample",
    "self_imitation_error",
]
