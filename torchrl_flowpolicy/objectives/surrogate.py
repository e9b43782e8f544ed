"""PPO's clipped surrogate and its diagnostics per (decision, stochastic step), on tensors.

Pure functions used by :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`: the
log-weights are ``[*B, K, 1]`` (one ratio per decision and denoising step, 0 at the
deterministic steps) and ``sde_mask [*B, K]`` marks the stochastic entries, the only ones that
enter an objective or a diagnostic.
"""

from __future__ import annotations

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
def ratio_diagnostics(surrogate: Surrogate, sde_mask: Tensor, entropy: Tensor) -> dict[str, Tensor]:
    """TorchRL's PPO diagnostics over the ``M`` stochastic entries (row-major order).

    ``clip_fraction`` (entries whose ratio the clip moved), ``kl_approx`` (the mean of
    ``-log_weight``, TorchRL's ``log pi_old - log pi_theta``), ``ESS`` (the effective sample size of the behaviour ratios over ``M``),
    ``mean_ratio`` / ``max_ratio`` (behaviour ratios), ``entropy`` (the mean of the entries'
    ``entropy [M]``), ``log_prob_drift`` (the largest ``|log_weight|``: about 0 before any
    update) and ``num_stochastic_steps`` (``M``). Without any stochastic entry, the values of
    unit ratios (0 and 1, not a mean of nothing).

    Examples:
        >>> bounds = (torch.tensor(0.8).log(), torch.tensor(1.2).log())
        >>> log_weight = torch.tensor([[[0.0], [0.5]]])  # one decision, K = 2
        >>> surrogate = clipped_surrogate(log_weight, torch.ones(1, 1, 1), bounds)
        >>> mask = torch.tensor([[False, True]])
        >>> diagnostics = ratio_diagnostics(surrogate, mask, torch.zeros(1))
        >>> diagnostics["clip_fraction"].item(), diagnostics["num_stochastic_steps"].item()
        (1.0, 1)
    """
    log_weight = surrogate.log_weight
    entries = log_weight[..., 0][sde_mask]
    behaviour_entries = surrogate.behaviour_log_weight[..., 0][sde_mask]
    num_entries = entries.numel()
    zero, one = entries.new_zeros(()), entries.new_ones(())
    if num_entries:
        clipped_entries = surrogate.clipped_log_weight[..., 0][sde_mask]
        clip_fraction = (clipped_entries != entries).to(entries.dtype).mean()
        ess = 2 * behaviour_entries.logsumexp(0) - (2 * behaviour_entries).logsumexp(0)
        ratio_entries = behaviour_entries.exp()
        diagnostics = {
            "clip_fraction": clip_fraction,
            "kl_approx": (-log_weight)[..., 0][sde_mask].mean(),
            "ESS": ess.exp() / num_entries,
            "mean_ratio": ratio_entries.mean(),
            "max_ratio": ratio_entries.max(),
            "entropy": entropy.mean(),
            "log_prob_drift": entries.abs().max(),
        }
    else:
        diagnostics = {
            "clip_fraction": zero,
            "kl_approx": zero,
            "ESS": one,
            "mean_ratio": one,
            "max_ratio": one,
            "entropy": zero.to(entropy.dtype),
            "log_prob_drift": zero,
        }
    diagnostics["num_stochastic_steps"] = torch.tensor(num_entries)
    return diagnostics
