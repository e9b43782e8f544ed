"""``SamplerOptions``: the Flow-SDE sampler's settings as one typed value.

The one route for the sampler settings: a command line's ``--sampler.*`` group builds it
(each field's ``metadata["help"]`` is its help line), :class:`~torchrl_flowpolicy.sampler.FlowSampler`
takes it whole and checks it (the one semantic check: it knows the dtype the grids are built
in), every checkpoint saves it (:meth:`SamplerOptions.to_dict`) and every loader reads it back
(:meth:`SamplerOptions.from_dict`). :func:`refuse_setting_attribute` keeps the sampler and the
policy from taking a setting as a plain attribute (``policy.noise_level = 0.3``), which nothing
would read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchrl_flowpolicy.flow import NoiseSchedule, SDEMode

__all__ = ["SamplerOptions", "FORMER_SETTING_NAMES", "refuse_setting_attribute"]


def _setting(default: Any, help: str) -> Any:
    """A field with its help line (``metadata["help"]``, which a command line shows)."""
    return dataclasses.field(default=default, metadata={"help": help})


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

    num_denoising_steps: int = _setting(
        8, "K: denoising steps of rollouts and of the learner's rescoring"
    )
    eval_num_denoising_steps: int = _setting(20, "K of the deterministic evaluation ODE")
    noise_level: float = _setting(
        0.5, "a: exploration noise of the Flow-SDE step (0: the Euler ODE)"
    )
    sde_mode: SDEMode = _setting(
        "mixed", "stochastic steps: one random step (mixed), the last num_sde_steps, all"
    )
    num_sde_steps: int = _setting(4, "how many steps sde_mode last makes stochastic")
    shift: float = _setting(1.0, "time shift s of the sigma grid (1: none)")
    noise_schedule: NoiseSchedule = _setting(
        "sqrt", "g = a sqrt(sigma / (1 - sigma)) (sqrt) or g = a (constant)"
    )
    rollout_noise_scale: float = _setting(1.0, "std of a rollout's initial noise x_0")
    eval_noise_scale: float = _setting(
        0.0, "std of an evaluation's x_0 (0: the noise-free chunk, 1: a sample by the ODE)"
    )

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


#: The settings' names from before they were grouped in :class:`SamplerOptions`, and their
#: fields (the others kept their names).
FORMER_SETTING_NAMES = {
    "num_steps": "num_denoising_steps",
    "eval_num_steps": "eval_num_denoising_steps",
}
_SETTING_NAMES = frozenset(field.name for field in dataclasses.fields(SamplerOptions))
_REFUSED_ATTRIBUTES = _SETTING_NAMES | frozenset(FORMER_SETTING_NAMES)


def refuse_setting_attribute(owner: str, name: str) -> None:
    """Raise an ``AttributeError`` when ``name`` is a :class:`SamplerOptions` field or a former
    name of one: ``{owner}.{name} = value`` would create an attribute that the sampler never
    reads. The message names the field and the one route, ``{owner}.options = ...``.

    Examples:
        >>> refuse_setting_attribute("policy", "in_keys")  # not a setting: returns None
        >>> refuse_setting_attribute("policy", "num_steps")
        Traceback (most recent call last):
        ...
        AttributeError: policy.num_steps = ... would change nothing: 'num_steps' is the former name of the setting 'num_denoising_steps', held by policy.options (a frozen SamplerOptions). Set it with policy.options = policy.options.replace(num_denoising_steps=...) ...
    """
    if name not in _REFUSED_ATTRIBUTES:
        return
    field = FORMER_SETTING_NAMES.get(name, name)
    what = "a sampler setting" if field == name else f"the former name of the setting {field!r}"
    raise AttributeError(
        f"{owner}.{name} = ... would change nothing: {name!r} is {what}, held "
        f"by {owner}.options (a frozen SamplerOptions). Set it with {owner}.options = "
        f"{owner}.options.replace({field}=...) (or dataclasses.replace({owner}.options, "
        f"{field}=...)): the new options are checked as a whole."
    )
