"""Checks of :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`'s options and data.

Options: each refuses, with a ``ValueError`` naming it, an option the loss cannot honour,
before any work: a bad clip range, critic options without a critic, TorchRL options that do
not apply to a flow policy (``delay_actor``, a per-head ``entropy_coeff``,
``samples_mc_entropy``). Data: the advantage, the stored per-step log-probs and the objective
are checked (one sum each when they are good) with an error naming the key, instead of the
NaN that one bad entry would spread to every weight through the optimiser.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import StochasticSteps
from torchrl_flowpolicy.policy import FlowSDEPolicy

__all__ = [
    "check_advantage",
    "check_clip_epsilon",
    "check_critic_free",
    "check_loss_options",
    "check_objective",
    "no_critic_error",
    "resolve_entropy_bonus",
    "stored_step_log_prob",
]


def check_clip_epsilon(clip_epsilon: float | tuple[float, float]) -> None:
    """Raise a ``ValueError`` unless ``clip_epsilon`` is a number in ``(0, 1)``, or a
    ``(low, high)`` pair with ``0 <= low < 1`` and finite ``high >= 0``.

    TorchRL validates the pair only; a scalar ``1.5`` would make ``log(1 - eps)`` NaN.

    Examples:
        >>> check_clip_epsilon((0.2, 0.28))  # valid: returns None
    """

    def number(value) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):
            return math.nan

    if isinstance(clip_epsilon, (tuple, list)):
        bounds = [number(eps) for eps in clip_epsilon]
        if len(bounds) != 2 or not (0 <= bounds[0] < 1 and 0 <= bounds[1] < math.inf):
            raise ValueError(
                f"clip_epsilon=(low, high) needs finite numbers with 0 <= low < 1 and "
                f"high >= 0, got {clip_epsilon!r}."
            )
    elif not 0 < number(clip_epsilon) < 1:
        raise ValueError(
            f"clip_epsilon must be in (0, 1) (the ratio is clipped to [1 - eps, 1 + eps]), got "
            f"{clip_epsilon!r}."
        )


# ClipPPOLoss options that only a critic serves (critic_coeff None or 0 means "no critic loss").
_CRITIC_OPTIONS = ("critic_coeff", "clip_value", "loss_critic_type")


def check_critic_free(options: Mapping[str, Any]) -> None:
    """Refuse, without a critic, the options that configure one."""
    given = [
        f"{name}={options[name]!r}"
        for name in _CRITIC_OPTIONS
        if name in options
        and not (name == "critic_coeff" and options[name] in (None, 0))
        and not (name == "clip_value" and options[name] is None)
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)}: critic options, and there is no critic "
            f"(critic_network=None). A critic-free loss reads the advantage from the batch (e.g. "
            f"GroupRelativeAdvantage); drop these options or pass a critic_network."
        )


def resolve_entropy_bonus(entropy_bonus: bool | None, options: Mapping[str, Any]) -> bool:
    """Whether the loss adds ``-entropy_coeff * entropy``, from ``entropy_bonus`` and the
    ``entropy_coeff`` in ``options``.

    ``None`` (the default): on exactly when an ``entropy_coeff > 0`` was passed, so that
    ``entropy_coeff=cfg.loss.entropy_coeff`` means what it means for ``ClipPPOLoss``.
    ``False`` with an ``entropy_coeff > 0`` asks for two contradicting things: refused.

    Examples:
        >>> resolve_entropy_bonus(None, {"entropy_coeff": 0.01}), resolve_entropy_bonus(None, {})
        (True, False)
    """
    coefficient = options.get("entropy_coeff")
    positive = coefficient is not None and float(coefficient) > 0
    if entropy_bonus is None:
        return positive
    if not entropy_bonus and positive:
        raise ValueError(
            f"entropy_coeff={coefficient!r} > 0 with entropy_bonus=False: the coefficient would "
            f"be ignored (loss_entropy stays 0). Drop entropy_bonus=False to add the bonus, or "
            f"pass entropy_coeff=0."
        )
    return bool(entropy_bonus)


def no_critic_error(what: str) -> ValueError:
    """The error of a critic-only operation (``what``) on a critic-free loss."""
    return ValueError(
        f"{what} needs a critic, and this loss has none (critic_network=None): the advantage "
        f"must be in the batch (e.g. written by GroupRelativeAdvantage). Pass a critic_network "
        f"to estimate it with TorchRL's value estimators."
    )


def check_loss_options(
    actor_network: object,
    critic_network: object,
    clip_epsilon: float | tuple[float, float],
    dual_clip: float | None,
    kl_coeff: float,
    bc_coeff: float,
    kl_estimator: str,
    options: Mapping[str, Any],
) -> None:
    """Refuse the loss's arguments it cannot honour (``options``: the keyword arguments for
    :class:`~torchrl.objectives.ClipPPOLoss`)."""
    if not isinstance(actor_network, FlowSDEPolicy):
        raise TypeError(
            f"actor_network must be a FlowSDEPolicy, got {type(actor_network).__name__}."
        )
    if options.get("delay_actor", False):
        raise ValueError("delay_actor=True is not supported by DenoisingClipPPOLoss.")
    if isinstance(options.get("entropy_coeff"), Mapping):
        raise ValueError(
            "entropy_coeff must be a number: a flow policy has one action head, so a "
            "per-head mapping does not apply."
        )
    if options.get("samples_mc_entropy", 1) != 1:
        raise ValueError(
            "samples_mc_entropy does not apply: the Gaussian steps' entropy is in closed form."
        )
    if critic_network is None:
        check_critic_free(options)
    check_clip_epsilon(clip_epsilon)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}.")
    if kl_coeff < 0 or bc_coeff < 0:
        raise ValueError(f"kl_coeff and bc_coeff must be >= 0, got {kl_coeff} and {bc_coeff}.")
    if kl_estimator not in ("analytic", "sample"):
        raise ValueError(f"kl_estimator must be 'analytic' or 'sample', got {kl_estimator!r}.")


def stored_step_log_prob(
    tensordict: TensorDictBase,
    key: NestedKey,
    steps: StochasticSteps,
    num_denoising_steps: int,
    check_data: bool = True,
) -> Tensor:
    """The stored per-step log-probs ``key`` ``[*B, K]`` at the stochastic entries, ``[M]``.

    Raises a ``KeyError`` when missing, a ``ValueError`` for another shape (or, with
    ``check_data``, a non-finite entry), a ``RuntimeError`` when they require grad.
    """
    old = tensordict.get(key, None)
    expected = (*tensordict.batch_size, num_denoising_steps)
    if old is None:
        raise KeyError(
            f"the stored per-step log-probs {key!r} are missing; FlowSDEPolicy writes "
            f"them under RANDOM exploration (set_keys(step_log_prob=...) to rename)."
        )
    if tuple(old.shape) != expected:
        raise ValueError(
            f"{key!r} has shape {tuple(old.shape)}, expected {expected} (one log-prob "
            f"per denoising step)."
        )
    if old.requires_grad:
        raise RuntimeError(f"the stored log-probs {key!r} require grad; detach them.")
    entries = old.reshape(-1, old.shape[-1])[steps.decision_index, steps.step_index]
    if check_data and not flow.all_finite(entries, f"the stored log-probs {key!r}"):
        bad = ~torch.isfinite(entries)
        raise ValueError(
            f"the stored log-probs {key!r} are not finite at {int(bad.sum())} stochastic "
            f"(decision, step) entries, e.g. {entries[bad][0].item()} at "
            f"{flow.format_step_entries(steps, bad, limit=1)}: the data were corrupted "
            f"(a ratio against them is inf or NaN, and so would be every gradient)."
        )
    return entries


def check_advantage(
    advantage: Tensor,
    key: NestedKey,
    tensordict: TensorDictBase,
    source: str,
    check_data: bool = True,
) -> None:
    """Refuse an advantage that is not ``[*B, 1]`` (or, with ``check_data``, not finite)."""
    expected = (*tensordict.batch_size, 1)
    if tuple(advantage.shape) != expected:
        raise ValueError(
            f"the advantage {key!r} has shape {tuple(advantage.shape)}, expected {expected}: "
            f"one value per decision (the tensordict's batch shape followed by 1)."
        )
    if check_data and not flow.all_finite(advantage, f"the advantage {key!r}"):
        raise ValueError(
            f"the advantage {key!r} is not finite for "
            f"{int((~torch.isfinite(advantage)).sum())} of {advantage.numel()} decisions "
            f"({source}): check the rewards, the value estimates and the data."
        )


def check_objective(loss_objective: Tensor, advantage: Tensor, log_weight: Tensor) -> None:
    """Refuse a non-finite ``loss_objective`` from finite data: an overflow."""
    if not flow.all_finite(loss_objective, "loss_objective"):
        raise ValueError(
            f"loss_objective is not finite although the stored data are: a ratio or an "
            f"advantage overflows {loss_objective.dtype} (largest |advantage| "
            f"{advantage.abs().max().item():.3g}, largest log-ratio "
            f"{log_weight.max().item():.3g}). Normalise the advantage "
            f"(normalize_advantage=True), scale the rewards, or check that the data were "
            f"collected by this policy (log_prob_drift)."
        )
