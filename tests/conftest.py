"""Shared test helpers: a closed-form Gaussian velocity field, a call-counting wrapper, the
checks of an example's held-out protocol and the example scripts loaded from their paths."""

from __future__ import annotations

import math

import pytest
import torch
from examples_loader import load_example
from torch import Tensor, nn


class GaussianVelocity(nn.Module):
    """The exact velocity ``E[noise - action | x_sigma = x]`` for Gaussian actions.

    Each coordinate of the action is independent, ``A ~ N(m, s^2)``, and
    ``x_sigma = (1 - sigma) A + sigma eps``. Then ``x_sigma ~ N((1 - sigma) m, V)`` with
    ``V = (1 - sigma)^2 s^2 + sigma^2``, and Gaussian conditioning gives

    ``E[eps - A | x] = -m + Cov(eps - A, x) / V * (x - (1 - sigma) m)``,
    ``Cov(eps - A, x) = sigma - (1 - sigma) s^2``.

    The context is ignored. ``mean`` and ``std`` have the chunk shape ``[H, D]``.
    """

    def __init__(self, mean: Tensor, std: Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def marginal(self, sigma: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and variance of ``x_sigma`` (``sigma`` broadcast against ``[H, D]``)."""
        variance = (1 - sigma) ** 2 * self.std**2 + sigma**2
        return (1 - sigma) * self.mean, variance

    def forward(self, x: Tensor, sigma: Tensor, context: object = None) -> Tensor:
        sigma = sigma.to(x.dtype).reshape(sigma.shape + (1,) * (x.ndim - sigma.ndim))
        marginal_mean, marginal_variance = self.marginal(sigma)
        covariance = sigma - (1 - sigma) * self.std**2
        return -self.mean + covariance / marginal_variance * (x - marginal_mean)


class CallCounter(nn.Module):
    """Wraps a module and counts its calls and the rows (leading dimension) it received."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.calls = 0
        self.rows: list[int] = []

    def forward(self, *args, **kwargs):
        self.calls += 1
        self.rows.append(args[0].shape[0])
        return self.module(*args, **kwargs)


def assert_gaussian_moments(
    samples: Tensor, mean: Tensor, std: Tensor, num_denoising_steps: int, *, z: float = 4.0
) -> None:
    """Check per-coordinate sample mean and variance against ``N(mean, std^2)``.

    Tolerance: ``z`` standard errors (``std / sqrt(n)`` for the mean,
    ``std^2 sqrt(2 / (n - 1))`` for the variance), plus ``5 / K * std^2`` for the variance's
    discretisation error. For the Gaussian velocity the Euler chain's mean is exactly
    ``(1 - sigma_k) m`` at every step (by induction; the score correction and the noise have
    zero mean), so the mean gets no allowance; the exact relative variance error is below
    ``5 / K`` for these targets (``test_exact_discretisation_error_is_first_order``), while a
    first-order error such as a drift without its score correction is not.

    Args:
        samples: ``[n, *event]``.
        mean: ``[*event]`` target mean.
        std: ``[*event]`` target standard deviation.
        num_denoising_steps: ``K``, the number of Euler steps used.
        z: the number of standard errors allowed.
    """
    samples = samples.double()
    mean, std = mean.double(), std.double()
    n = samples.shape[0]
    discretisation = 5.0 / num_denoising_steps
    mean_tolerance = z * std / math.sqrt(n)
    variance_tolerance = std**2 * (z * math.sqrt(2.0 / (n - 1)) + discretisation)
    mean_error = (samples.mean(0) - mean).abs()
    variance_error = (samples.var(0) - std**2).abs()
    assert (mean_error <= mean_tolerance).all(), (mean_error, mean_tolerance)
    assert (variance_error <= variance_tolerance).all(), (variance_error, variance_tolerance)


@pytest.fixture
def gaussian_velocity() -> GaussianVelocity:
    """Exact velocity for a ``(2, 2)`` chunk with varied per-coordinate means and scales."""
    mean = torch.tensor([[0.5, -1.0], [0.0, 2.0]])
    std = torch.tensor([[0.3, 1.5], [1.0, 0.5]])
    return GaussianVelocity(mean, std)


@pytest.fixture
def check_gaussian_moments():
    """:func:`assert_gaussian_moments`, for the test modules."""
    return assert_gaussian_moments


@pytest.fixture
def counting():
    """The :class:`CallCounter` class, for the test modules."""
    return CallCounter


@pytest.fixture(autouse=True)
def single_thread():
    """Run every test with one intra-op thread (small tensors; avoids oversubscribed CPUs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_protocol_fields(
    summary: dict, stdout: str, name: str, reported: str, split: str = "held_out"
) -> None:
    """The protocol of a ``--quick`` run (8 episodes; held-out states unless ``split`` says
    validation) in its summary and last line."""
    held_out = summary["held_out"]
    first_seed = {"held_out": 30_000, "validation": 20_000}[split]
    assert (held_out["split"], held_out["seed"], held_out["num_episodes"]) == (split, first_seed, 8)
    assert held_out["reported_decoding"] == reported
    assert held_out["bc_best_decoding"] in ("sampled", "noise_free")
    for group in ("bc", "rl"):
        for decoding in ("sampled", "noise_free"):
            entry = held_out["success"][group][decoding]
            assert entry["low"] <= entry["rate"] <= entry["high"]
            assert len(held_out["episode_success"][group][decoding]) == 8
    assert held_out["success"]["expert"]["low"] <= held_out["success"]["expert"]["high"]
    for name_of_difference in ("rl_minus_bc_best", "rl_minus_expert"):
        for entry in held_out[name_of_difference].values():
            assert entry["low"] <= entry["difference"] <= entry["high"]
    assert list(summary["curve_baselines"]) == ["BC (sampled)", "BC (noise-free)", "expert"]
    last_line = stdout.strip().splitlines()[-1]
    states = "held-out" if split == "held_out" else "validation"
    assert last_line == f"{states} seeds: {held_out['line']}"
    assert last_line.startswith(f"{states} seeds: {name} ({reported.replace('_', '-')}) ")


@pytest.fixture
def check_protocol_fields():
    """:func:`assert_protocol_fields`, for the example tests."""
    return assert_protocol_fields


@pytest.fixture
def example():
    """:func:`load_example`, for the test modules: ``example("ppo").parse_args([...])``."""
    return load_example
