"""The Gaussian terms of a stochastic step: log-density, entropy and KL, with an action mask.

Pure tensor functions, computed in float32 or wider whatever the input dtype. Each accepts
``std`` either as one scale per event (the fixed Flow-SDE schedule's ``std_k``, broadcast
over the chunk) or as one value per entry (a learned noise, see
:mod:`~torchrl_flowpolicy.flow.noise`), and an optional boolean ``mask`` that keeps some
entries out of every term: padded action dimensions (pi0 pads its actions to 32 dimensions)
are never scored. A masked entry's values, even NaN or inf, change neither the result nor
its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchrl_flowpolicy.flow.sde import probability_dtype

__all__ = ["check_action_mask", "gaussian_log_prob", "gaussian_entropy", "gaussian_kl"]

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


def _std_per_entry(std: Tensor, shape: torch.Size, event_dims: int) -> bool:
    """Whether ``std`` has one value per entry (``True``) or one per event (``False``).

    One per entry: ``std`` has the sample's number of dimensions and broadcasts to ``shape``
    (a learned noise, ``[..., H, D]``, or ``[..., 1, D]`` shared over the rows). One per event:
    ``std`` has the batch shape ``shape[:-event_dims]`` (the fixed schedule's ``std_k``).
    """
    if std.ndim == len(shape):
        return True
    if tuple(std.shape) == tuple(shape[: len(shape) - event_dims]):
        return False
    raise ValueError(
        f"std has shape {tuple(std.shape)}; expected one value per event, "
        f"{tuple(shape[: len(shape) - event_dims])}, or one per entry, broadcastable to "
        f"{tuple(shape)}."
    )


def _entry_mask(mask: Tensor, shape: torch.Size, device: torch.device) -> Tensor:
    """``mask`` (booleans, ``True`` for the scored entries) broadcast to ``shape``."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a boolean tensor (True for the entries to score, e.g. the real "
            f"action dimensions [D]), got {type(mask).__name__}"
            f"{'' if not isinstance(mask, Tensor) else f' of dtype {mask.dtype}'}."
        )
    try:
        return torch.broadcast_to(mask.to(device), shape)
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the sample's shape "
            f"{tuple(shape)} (an action mask over D dimensions is [D])."
        ) from None


def check_action_mask(action_mask: Tensor, action_dim: int) -> None:
    """Raise a ``ValueError`` unless ``action_mask`` is a ``[action_dim]`` boolean tensor with
    at least one ``True`` (the real action dimensions; the others are padding).

    Examples:
        >>> check_action_mask(torch.tensor([True, True, False]), 3)  # valid: returns None
    """
    if not (
        isinstance(action_mask, Tensor)
        and action_mask.dtype == torch.bool
        and tuple(action_mask.shape) == (action_dim,)
        and bool(action_mask.any())
    ):
        raise ValueError(
            f"action_mask must be a boolean tensor of shape ({action_dim},) (the action "
            f"dimension D), True for the real dimensions and with at least one True; got "
            f"{action_mask!r}."
        )


def gaussian_log_prob(
    x: Tensor, mean: Tensor, std: Tensor, event_dims: int = 2, mask: Tensor | None = None
) -> Tensor:
    """``log N(x; mean, diag(std^2))`` summed over the last ``event_dims`` dimensions.

    Computed in float32 or wider. ``std`` is either one scale per event, with the batch shape
    of ``x`` minus its event dimensions (the fixed schedule: broadcast over the chunk), or
    one per entry, with the dimensions of ``x`` (a learned noise; size-1 dimensions
    broadcast).

    Args:
        x: the sample, ``[..., H, D]`` for the default ``event_dims = 2``.
        mean: the Gaussian mean, same shape as ``x``.
        std: the standard deviation (> 0), shape ``x.shape[:-event_dims]`` or broadcastable
            to ``x.shape`` with ``x.ndim`` dimensions.
        event_dims: how many trailing dimensions form one event.
        mask: booleans broadcastable to ``x.shape`` (``[D]`` for the action dimensions),
            ``True`` for the scored entries; the others add nothing (``None``: all).

    Returns:
        The log-density, shape ``x.shape[:-event_dims]``.

    Examples:
        >>> gaussian_log_prob(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor(1.0))
        tensor(-0.9189)
        >>> per_entry = torch.tensor([[1.0, 2.0]])  # one std per entry
        >>> torch.distributions.Normal(0.0, per_entry).log_prob(torch.ones(1, 2)).sum()
        tensor(-3.1560)
        >>> gaussian_log_prob(torch.ones(1, 2), torch.zeros(1, 2), per_entry)
        tensor(-3.1560)

        The second dimension padded, whatever it holds:

        >>> real = torch.tensor([True, False])
        >>> gaussian_log_prob(torch.tensor([[0.0, 9.0]]), torch.zeros(1, 2), torch.tensor(1.0), mask=real)
        tensor(-0.9189)
    """
    dtype = probability_dtype(x.dtype)
    if not x.dtype == mean.dtype == std.dtype == dtype:
        x, mean, std = x.to(dtype), mean.to(dtype), std.to(dtype)
    event_shape = x.shape[x.ndim - event_dims :]
    per_entry = _std_per_entry(std, x.shape, event_dims)
    if mask is None:
        num_elements = math.prod(event_shape)
        if per_entry:
            std = torch.broadcast_to(std, x.shape)
            squared = ((x - mean) / std).pow(2).flatten(-event_dims).sum(-1)
            log_std = std.log().flatten(-event_dims).sum(-1)
            return -0.5 * squared - log_std - num_elements * _HALF_LOG_TWO_PI
        std_b = std.reshape(std.shape + (1,) * event_dims)
        squared = ((x - mean) / std_b).pow(2).flatten(-event_dims).sum(-1)
        return -0.5 * squared - num_elements * (std.log() + _HALF_LOG_TWO_PI)
    mask = _entry_mask(mask, x.shape, x.device)
    count = mask.flatten(-event_dims).sum(-1).to(dtype)
    difference = torch.where(mask, x - mean, 0.0)
    if per_entry:
        std = torch.where(mask, torch.broadcast_to(std, x.shape), 1.0)
        squared = (difference / std).pow(2).flatten(-event_dims).sum(-1)
        log_std = std.log().flatten(-event_dims).sum(-1)
        return -0.5 * squared - log_std - count * _HALF_LOG_TWO_PI
    std_b = std.reshape(std.shape + (1,) * event_dims)
    squared = (difference / std_b).pow(2).flatten(-event_dims).sum(-1)
    return -0.5 * squared - count * (std.log() + _HALF_LOG_TWO_PI)


def gaussian_entropy(
    std: Tensor, shape: Sequence[int], event_dims: int = 2, mask: Tensor | None = None
) -> Tensor:
    """The entropy of ``N(mean, diag(std^2))`` over events of the last ``event_dims`` of ``shape``.

    ``sum over the event's (scored) entries of log std + log(2 pi e) / 2``. ``std`` is one
    scale per event (shape ``shape[:-event_dims]``) or one per entry (``len(shape)``
    dimensions, broadcastable to ``shape``), as in :func:`gaussian_log_prob`. Only ``std``
    enters: with a learned std this is what an entropy bonus differentiates.

    Args:
        std: the standard deviation (> 0).
        shape: the shape of a sample, ``[..., H, D]``.
        event_dims: how many trailing dimensions form one event.
        mask: booleans broadcastable to ``shape``, ``True`` for the entries that count
            (``None``: all).

    Returns:
        The entropy, shape ``shape[:-event_dims]``, in float32 or wider.

    Examples:
        >>> std = torch.tensor([[0.5, 2.0]])
        >>> torch.distributions.Normal(0.0, std).entropy().sum()
        tensor(2.8379)
        >>> gaussian_entropy(std, (1, 2))
        tensor(2.8379)
    """
    shape = torch.Size(shape)
    std = std.to(probability_dtype(std.dtype))
    constant = 0.5 * math.log(2 * math.pi * math.e)
    per_entry = _std_per_entry(std, shape, event_dims)
    if mask is None:
        if per_entry:
            return (torch.broadcast_to(std, shape).log() + constant).flatten(-event_dims).sum(-1)
        return math.prod(shape[len(shape) - event_dims :]) * (std.log() + constant)
    mask = _entry_mask(mask, shape, std.device)
    if per_entry:
        std = torch.where(mask, torch.broadcast_to(std, shape), 1.0)
        return torch.where(mask, std.log() + constant, 0.0).flatten(-event_dims).sum(-1)
    count = mask.flatten(-event_dims).sum(-1).to(std.dtype)
    return count * (std.log() + constant)


def gaussian_kl(
    mean: Tensor,
    std: Tensor,
    other_mean: Tensor,
    other_std: Tensor,
    event_dims: int = 2,
    mask: Tensor | None = None,
) -> Tensor:
    """``KL(N(mean, diag(std^2)) || N(other_mean, diag(other_std^2)))``, summed over the event.

    The closed form for two diagonal Gaussians, per entry
    ``log(s' / s) + (s^2 + (m - m')^2) / (2 s'^2) - 1 / 2``. Each std is one scale per event
    or one per entry (:func:`gaussian_log_prob`); with the same std per event it reduces to
    ``||m - m'||^2 / (2 s^2)``, the fixed schedule's KL.

    Args:
        mean: the first Gaussian's mean (``[..., H, D]``).
        std: its std (as in :func:`gaussian_log_prob`).
        other_mean: the second Gaussian's mean, the same shape.
        other_std: its std, as ``std``.
        event_dims: how many trailing dimensions form one event.
        mask: booleans broadcastable to ``mean.shape``, ``True`` for the entries that count
            (``None``: all).

    Returns:
        The KL divergence, shape ``mean.shape[:-event_dims]``, in float32 or wider.

    Examples:
        >>> p, q = torch.distributions.Normal(0.0, 1.0), torch.distributions.Normal(1.0, 2.0)
        >>> torch.distributions.kl_divergence(p, q)
        tensor(0.4431)
        >>> gaussian_kl(torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), torch.full((1, 1), 2.0))
        tensor(0.4431)
    """
    dtype = probability_dtype(mean.dtype)
    mean, other_mean = mean.to(dtype), other_mean.to(dtype)
    std, other_std = std.to(dtype), other_std.to(dtype)
    shape = mean.shape
    if mask is None:
        squared = (mean - other_mean).pow(2)
    else:
        mask = _entry_mask(mask, shape, mean.device)
        squared = torch.where(mask, mean - other_mean, 0.0).pow(2)
    per_entry = _std_per_entry(std, shape, event_dims)
    other_per_entry = _std_per_entry(other_std, shape, event_dims)
    if not (per_entry or other_per_entry):
        # One scale per event on both sides: sum the n equal terms in closed form.
        if mask is None:
            num_elements = math.prod(shape[len(shape) - event_dims :])
        else:
            num_elements = mask.flatten(-event_dims).sum(-1).to(dtype)
        variance, other_variance = std.pow(2), other_std.pow(2)
        scale = (other_std / std).log() + variance / (2 * other_variance) - 0.5
        return num_elements * scale + squared.flatten(-event_dims).sum(-1) / (2 * other_variance)
    expand = [
        torch.broadcast_to(s if entry else s.reshape(s.shape + (1,) * event_dims), shape)
        for s, entry in ((std, per_entry), (other_std, other_per_entry))
    ]
    std, other_std = expand
    if mask is not None:  # unit stds at the masked entries: their KL is exactly 0
        std, other_std = torch.where(mask, std, 1.0), torch.where(mask, other_std, 1.0)
    other_variance = other_std.pow(2)
    kl = (other_std / std).log() + (std.pow(2) + squared) / (2 * other_variance) - 0.5
    return kl.flatten(-event_dims).sum(-1)
