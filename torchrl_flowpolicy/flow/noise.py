"""The learned exploration noise: a per-entry step std squashed into ``[min_std, max_std]``.

Pure tensor functions for the learned-noise sampler of pi-RL's Flow-Noise (Chen et al., 2025)
and ReinFlow (Zhang et al., 2025). A stochastic step keeps the Euler ODE mean and adds
Gaussian noise whose standard deviation a small network predicts for every entry of the
chunk:

``mean_k = x_k + v(x_k, sigma_k) Delta_k``, ``std_k = s(x_k, sigma_k, context)``,
``x_{k+1} = mean_k + std_k * xi_k``, ``xi_k ~ N(0, I)``.

The network's raw output ``z`` is mapped to the std through a sigmoid in log space,

``log std = log min_std + (log max_std - log min_std) * sigmoid(z)``,

so the std can neither collapse to 0 nor explode, whatever the parameters
(:func:`bounded_std`); :func:`bounded_std_logit` is its inverse, used to start the network at a
chosen std. The log-density, entropy and KL of such steps are
:func:`~torchrl_flowpolicy.flow.gaussian_log_prob`, :func:`~torchrl_flowpolicy.flow.gaussian_entropy`
and :func:`~torchrl_flowpolicy.flow.gaussian_kl` with a per-entry std; the sampling is
:func:`~torchrl_flowpolicy.flow.integrate` with its ``noise_std`` callback. See
``docs/learned_noise.md``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["check_std_bounds", "bounded_std", "bounded_std_logit"]


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_std_bounds(min_std: float, max_std: float, initial_std: float | None = None) -> None:
    """Raise a ``ValueError`` naming the argument unless ``0 < min_std < max_std`` (finite),
    and, when given, ``min_std < initial_std < max_std``.

    The initial std must lie strictly inside the bounds: the squashing reaches a bound only
    at an infinite raw output.

    Examples:
        >>> check_std_bounds(0.02, 0.3, 0.08)  # valid: returns None
        >>> check_std_bounds(0.3, 0.02)
        Traceback (most recent call last):
        ...
        ValueError: min_std must be < max_std, got min_std=0.3 and max_std=0.02.
    """
    for name, value in (("min_std", min_std), ("max_std", max_std)):
        if not (_is_number(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    if not min_std < max_std:
        raise ValueError(
            f"min_std must be < max_std, got min_std={min_std!r} and max_std={max_std!r}."
        )
    if initial_std is not None and not (
        _is_number(initial_std) and min_std < initial_std < max_std
    ):
        raise ValueError(
            f"initial_std must be a finite number strictly between min_std={min_std!r} and "
            f"max_std={max_std!r}, got {initial_std!r}."
        )


def bounded_std(raw: Tensor, min_std: float, max_std: float) -> Tensor:
    """The std ``exp(log min + (log max - log min) * sigmoid(raw))``, in ``[min_std, max_std]``.

    A sigmoid in log space: ``raw = 0`` gives the geometric mean ``sqrt(min_std * max_std)``,
    and equal steps of ``raw`` scale the std by equal factors near the middle. The bounds
    hold for any finite or infinite ``raw`` (NaN stays NaN).

    Args:
        raw: the network's output, any shape.
        min_std: the lower bound (> 0).
        max_std: the upper bound (> ``min_std``).

    Examples:
        >>> bounded_std(torch.tensor([-1e9, 0.0, 1e9]), 0.01, 1.0)
        tensor([0.0100, 0.1000, 1.0000])
    """
    log_min = math.log(min_std)
    return torch.exp(log_min + (math.log(max_std) - log_min) * torch.sigmoid(raw))


def bounded_std_logit(std: float, min_std: float, max_std: float) -> float:
    """The raw output at which :func:`bounded_std` gives ``std`` (its inverse).

    Raises a ``ValueError`` unless ``min_std < std < max_std`` (:func:`check_std_bounds`).

    Examples:
        >>> raw = bounded_std_logit(0.05, 0.01, 1.0)
        >>> round(bounded_std(torch.tensor(raw), 0.01, 1.0).item(), 6)
        0.05
    """
    check_std_bounds(min_std, max_std, std)
    fraction = (math.log(std) - math.log(min_std)) / (math.log(max_std) - math.log(min_std))
    return math.log(fraction) - math.log1p(-fraction)
