"""Reinforcement-learning fine-tuning of flow-matching action policies in TorchRL.

The library is at the top: :mod:`~torchrl_flowpolicy.flow` (the math),
:mod:`~torchrl_flowpolicy.sampler` and :mod:`~torchrl_flowpolicy.policy` (the policy),
:mod:`~torchrl_flowpolicy.networks`, :mod:`~torchrl_flowpolicy.objectives`,
:mod:`~torchrl_flowpolicy.dsrl` and :mod:`~torchrl_flowpolicy.envs` (chunked execution for
any TorchRL environment). :mod:`~torchrl_flowpolicy.tasks` holds the benchmark tasks with
their experts and demonstrations, :mod:`~torchrl_flowpolicy.training` what runs and
evaluates the experiments; :mod:`~torchrl_flowpolicy.integrations` the optional bridges.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from torchrl_flowpolicy.networks import TimeReversedVelocity
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training import _moved
from torchrl_flowpolicy.training.models import load_policy

_moved.install()  # the old module paths, for one release (torchrl_flowpolicy.training._moved)


def __getattr__(name: str) -> ModuleType:
    """A module that moved into :mod:`torchrl_flowpolicy.training`, asked for as an attribute
    of its old parent: the new module, with a ``DeprecationWarning``."""
    if f"{__name__}.{name}" not in _moved.MOVED_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


__all__ = ["FlowSDEPolicy", "SamplerOptions", "TimeReversedVelocity", "load_policy"]
__version__ = "0.1.0"
