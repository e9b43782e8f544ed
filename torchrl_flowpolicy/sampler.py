"""The Flow-SDE sampler's settings as one typed value.

:class:`SamplerOptions` is the one route for the sampler settings: a command line's
``--sampler.*`` group builds it, the policy takes it whole, every checkpoint saves it
(:meth:`SamplerOptions.to_dict`) and every loader reads it back (:meth:`SamplerOptions.from_dict`).
The dataclass only holds values; their meaning is checked once, by the sampler that uses
them (it knows the dtype the grids are built in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchrl_flowpolicy.flow import NoiseSchedule, SDEMode

__all__ = ["SamplerOptions"]


@dataclass(frozen=True)
class SamplerOptions:
    """Settings of the Flow-SDE sampler (rollouts, the learner's rescoring, evaluation).

    Attributes:
        num_denoising_steps: ``K``, the Euler steps of a rollout chain (and of the
            learner's rescoring: a stored chain must have ``K + 1`` entries).
        eval_num_denoising_steps: the ODE's steps under DETERMINISTIC exploration.
        noise_level: ``a``, the Flow-SDE noise scale (0 gives the Euler ODE).
        sde_mode: which steps are stochastic: ``"mixed"`` (one random step in 1..K-1 per
            decision), ``"last"`` (the last ``num_sde_steps``), ``"all"`` (1..K-1).
        num_sde_steps: how many steps ``"last"`` makes stochastic.
        shift: the sigma grid's time shift ``s`` (1: none).
        noise_schedule: ``"sqrt"`` (``g = a sqrt(sigma / (1 - sigma))``) or ``"constant"``
            (``g = a``).
        rollout_noise_scale: the scale of a rollout's initial noise ``x_0``.
        eval_noise_scale: the scale of an evaluation's ``x_0`` (0: the noise-free chunk,
            1: a sample of the model's distribution by the ODE).

    Example:
        >>> from torchrl_flowpolicy.sampler import SamplerOptions
        >>> options = SamplerOptions(num_denoising_steps=4, noise_level=0.3)
        >>> SamplerOptions.from_dict(options.to_dict()) == options
        True
    """

    num_denoising_steps: int = 8
    eval_num_denoising_steps: int = 20
    noise_level: float = 0.5
    sde_mode: SDEMode = "mixed"
    num_sde_steps: int = 4
    shift: float = 1.0
    noise_schedule: NoiseSchedule = "sqrt"
    rollout_noise_scale: float = 1.0
    eval_noise_scale: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (what a checkpoint stores)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplerOptions:
        """The options a checkpoint stored; an unknown name is an error naming it."""
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"unknown sampler option(s) {unknown}; SamplerOptions has {sorted(names)}."
            )
        return cls(**values)

    def replace(self, **changes: Any) -> SamplerOptions:
        """A copy with some settings changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
