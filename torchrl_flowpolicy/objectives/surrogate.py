"""PPO's clipped surrogate and its diagnostics per (decision, stochastic step), on tensors.

Pure functions used by :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`: the
log-weights are ``[*B, K, 1]`` (one ratio per decision and denoising step, 0 at the
deterministic steps) and ``sde_mask [*B, K]`` marks the stochastic entries, the only ones that
enter an objective or a diagnostic.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Surrogate", "clipped_surrogate", "ratio_diagnostics"]


class Surrogate(NamedTuple):
    """PPO's surrogate per entry (:func:`clipped_surrogate`), all ``[*B, K, 1]``.

    Attributes:
        gain: ``min(rho A, clip(rho) A)`` (floored at ``c A`` for ``A < 0`` with dual clip).
        log_weight: ``log pi_theta / pi_old``, the input (0 at the deterministic steps).
        clipped_log_weight: the log-weight clamped to the clip bounds.
        behaviour_log_weight: ``log pi_theta / pi_behaviour``, the log-weight plus the
            importance correction (the log-weight itself without one).
    """

    gain: Tensor
    log_weight: Tensor
    clipped_log_weight: Tensor
    behaviour_log_weight: Tensor


def clipped_surrogate(
    log_weight: Tensor,
    advantage: Tensor,
    clip_bounds: tuple[Tensor, Tensor],
    log_is_weight: Tensor | None = None,
    dual_clip: float | None = None,
) -> Surrogate:
    """PPO's clipped surrogate (Schulman et al., 2017), with dual clip (Ye et al., 2020).

    ``gain = min(rho A, clip(rho_prox, low, high) w A)`` with ``rho = exp(log_weight +
    log_is_weight)`` the ratio to the behaviour policy, ``w = exp(log_is_weight)`` (1
    without a correction) and ``clip_bounds`` the log-space bounds
    ``(log(1 - eps_low), log(1 + eps_high))``; with ``dual_clip = c`` a negative
    advantage's gain is floored at ``c A``.

    Examples:
        >>> bounds = (torch.tensor(0.8).log(), torch.tensor(1.2).log())
        >>> log_weight = torch.tensor([[[0.5]], [[0.0]]])  # ratios e^0.5 and 1
        >>> clipped_surrogate(log_weight, torch.ones(2, 1, 1), bounds).gain.flatten()
        tensor([1.2000, 1.0000])
    """
    clipped = log_weight.clamp(*clip_bounds)
    if log_is_weight is None:  # the surrogate is weighted by pi_theta / pi_behaviour
        behaviour, clipped_behaviour = log_weight, clipped
    else:
        behaviour, clipped_behaviour = log_weight + log_is_weight, clipped + log_is_weight
    ratio = behaviour.exp()
    gain = torch.minimum(ratio * advantage, clipped_behaviour.exp() * advantage)
    if dual_clip is not None:
        floor = dual_clip * advantage
        gain = torch.where(advantage < 0, torch.maximum(gain, floor), gain)
    return Surrogate(gain, log_weight, clipped, behaviour)


@torch.no_grad()
def ratio_diagnostics(
    surrogate: Surrogate,
    sde_mask: Tensor,
    entropy: Tensor,
    old_log_prob: Tensor | None = None,
) -> dict[str, Tensor]:
    """TorchRL's PPO diagnostics over the ``M`` stochastic entries.

    ``clip_fraction`` (entries whose ratio the clip moved), ``kl_approx`` (the mean of
    ``-log_weight``, TorchRL's ``log pi_old - log pi_theta``), ``ESS`` (the effective sample
    size of the behaviour ratios over ``M``), ``mean_ratio`` / ``max_ratio`` (behaviour
    ratios), ``entropy`` (the mean of the entries' ``entropy [M]``), ``log_prob_drift`` (the
    largest ``|log_weight|``: about 0 before any update), ``log_prob_drift_relative`` (the
    drift divided by ``max(1, max |log pi_old|)`` over the stochastic entries; written when
    ``old_log_prob [*B, K]`` is given) and ``num_stochastic_steps``
    (``M``). Without any stochastic entry, the values of unit ratios (0 and 1, not a mean of
    nothing).

    Every reduction is masked over the ``[*B, K]`` grid rather than indexed with the mask, so
    that the function has no data-dependent shape (no graph break under ``torch.compile``).

    Examples:
        >>> bounds = (torch.tensor(0.8).log(), torch.tensor(1.2).log())
        >>> log_weight = torch.tensor([[[0.0], [0.5]]])  # one decision, K = 2
        >>> surrogate = clipped_surrogate(log_weight, torch.ones(1, 1, 1), bounds)
        >>> mask = torch.tensor([[False, True]])
        >>> old = torch.tensor([[-40.0, -25.0]])  # the stored log-probs (step 0 is not scored)
        >>> diagnostics = ratio_diagnostics(surrogate, mask, torch.zeros(1), old)
        >>> diagnostics["clip_fraction"].item(), diagnostics["num_stochastic_steps"].item()
        (1.0, 1)
        >>> round(diagnostics["log_prob_drift_relative"].item(), 6)  # 0.5 / 25
        0.02
    """
    log_weight = surrogate.log_weight[..., 0]
    behaviour = surrogate.behaviour_log_weight[..., 0]
    clipped = surrogate.clipped_log_weight[..., 0]
    num_entries = sde_mask.sum()
    some = num_entries > 0
    count = num_entries.clamp_min(1).to(log_weight.dtype)
    zero, one = log_weight.new_zeros(()), log_weight.new_ones(())
    masked_behaviour = behaviour.masked_fill(~sde_mask, -math.inf)
    flat = masked_behaviour.flatten()
    ess = 2 * flat.logsumexp(0) - (2 * flat).logsumexp(0)
    ratios = behaviour.exp()
    scale = zero
    if log_weight.numel():  # a static shape: no branch on the data
        drift = log_weight.abs().masked_fill(~sde_mask, 0.0).amax()
        max_ratio = torch.where(some, ratios.masked_fill(~sde_mask, 0.0).amax(), one)
        if old_log_prob is not None:
            scale = old_log_prob.abs().masked_fill(~sde_mask, 0.0).amax().to(zero)
    else:
        drift, max_ratio = zero, one
    diagnostics = {
        "clip_fraction": ((clipped != log_weight) & sde_mask).sum().to(count) / count,
        "kl_approx": (-log_weight).masked_fill(~sde_mask, 0.0).sum() / count,
        "ESS": torch.where(some, ess.exp() / count, one),
        "mean_ratio": torch.where(some, ratios.masked_fill(~sde_mask, 0.0).sum() / count, one),
        "max_ratio": max_ratio,
        "entropy": entropy.sum() / count.to(entropy.dtype),
        "log_prob_drift": drift,
    }
    if old_log_prob is not None:
        diagnostics["log_prob_drift_relative"] = drift / scale.clamp_min(1.0)
    diagnostics["num_stochastic_steps"] = num_entries
    return diagnostics
