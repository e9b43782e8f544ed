"""Flow-matching training math: the interpolant, the velocity target, noise levels, the error.

Pure tensor functions used by :class:`~torchrl_flowpolicy.objectives.FlowMatchingLoss`
(pretraining and self-imitation); see :mod:`torchrl_flowpolicy.flow` for the convention.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from torchrl_flowpolicy.flow.sde import probability_dtype

__all__ = [
    "interpolate",
    "velocity_target",
    "SigmaDistribution",
    "sample_training_sigma",
    "flow_matching_error",
]


def interpolate(action: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    """The flow-matching interpolant ``x_sigma = (1 - sigma) * action + sigma * noise``.

    ``sigma`` is broadcast from the left: shape ``[N]`` against ``[N, H, D]`` works.
    """
    sigma = sigma.reshape(sigma.shape + (1,) * (action.ndim - sigma.ndim))
    return (1.0 - sigma) * action + sigma * noise


def velocity_target(action: Tensor, noise: Tensor) -> Tensor:
    """The flow-matching regression target ``v = noise - action``."""
    return noise - action


SigmaDistribution = Literal["uniform", "logit_normal", "beta"]


def sample_training_sigma(
    shape: tuple[int, ...] | torch.Size,
    distribution: SigmaDistribution = "uniform",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Noise levels for flow-matching training, drawn from the global RNG.

    * ``"uniform"``: ``sigma ~ U(0, 1)`` (rectified flow).
    * ``"logit_normal"``: ``sigma = sigmoid(z)``, ``z ~ N(0, 1)`` (Stable Diffusion 3).
    * ``"beta"``: pi0's schedule in this convention: ``sigma = 0.001 + 0.999 u``,
      ``u ~ Beta(1.5, 1)``, which favours high noise.

    Examples:
        >>> sample_training_sigma((5,)).shape
        torch.Size([5])
    """
    if distribution == "uniform":
        return torch.rand(shape, dtype=dtype, device=device)
    if distribution == "logit_normal":
        return torch.sigmoid(torch.randn(shape, dtype=dtype, device=device))
    if distribution == "beta":
        concentration = torch.tensor([1.5, 1.0], dtype=dtype, device=device)
        u = torch.distributions.Beta(concentration[0], concentration[1]).sample(shape)
        return 0.001 + 0.999 * u
    raise ValueError(
        f"sigma distribution must be 'uniform', 'logit_normal' or 'beta', got {distribution!r}."
    )


def flow_matching_error(
    predicted_velocity: Tensor,
    action: Tensor,
    noise: Tensor,
    row_mask: Tensor | None = None,
    action_mask: Tensor | None = None,
) -> Tensor:
    """Per-sample flow-matching error ``mean ||v_pred - (noise - action)||^2``.

    The squared error is averaged over the (real) action dimensions and the valid chunk rows.

    Args:
        predicted_velocity: ``[N, H, D]``.
        action: the target chunk, ``[N, H, D]``.
        noise: the noise it was interpolated with, ``[N, H, D]``.
        row_mask: ``[N, H]`` booleans, ``True`` for real (non-padding) rows; ``None``: all.
        action_mask: ``[D]`` booleans, ``True`` for the real action dimensions (padded ones
            are not trained, whatever they hold); ``None``: all.

    Returns:
        ``[N]``; 0 for a sample without valid rows.

    Examples:
        >>> target = torch.zeros(1, 1, 2)
        >>> flow_matching_error(torch.tensor([[[1.0, 5.0]]]), target, target)
        tensor([13.])
        >>> flow_matching_error(
        ...     torch.tensor([[[1.0, 5.0]]]), target, target, action_mask=torch.tensor([True, False])
        ... )
        tensor([1.])
    """
    dtype = probability_dtype(predicted_velocity.dtype)
    error = (predicted_velocity.to(dtype) - velocity_target(action, noise).to(dtype)).pow(2)
    if action_mask is None:
        error = error.mean(-1)
    else:
        real = action_mask.to(error.device)
        error = torch.where(real, error, 0.0).sum(-1) / real.sum().clamp_min(1)
    if row_mask is None:
        return error.mean(-1)
    row_mask = row_mask.to(dtype)
    return (error * row_mask).sum(-1) / row_mask.sum(-1).clamp_min(1.0)
