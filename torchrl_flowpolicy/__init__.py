"""Reinforcement-learning fine-tuning of flow-matching action policies in TorchRL."""

from torchrl_flowpolicy.networks import TimeReversedVelocity
from torchrl_flowpolicy.policy import FlowSDEPolicy

__all__ = ["FlowSDEPolicy", "TimeReversedVelocity"]
__version__ = "0.1.0"
