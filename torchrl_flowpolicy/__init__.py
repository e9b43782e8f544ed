"""Reinforcement-learning fine-tuning of flow-matching action policies in TorchRL."""

from torchrl_flowpolicy.models import load_policy
from torchrl_flowpolicy.networks import TimeReversedVelocity
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions

__all__ = ["FlowSDEPolicy", "SamplerOptions", "TimeReversedVelocity", "load_policy"]
__version__ = "0.1.0"
