"""Closed-form and behaviour-pinning tests of the pure Flow-SDE math in ``flow.py``."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from torchrl_flowpolicy import flow

MODES = ("mixed", "last", "all")


# --------------------------------------------------------------------------- sigma grid
@pytest.mark.parametrize("num_denoising_steps", [1, 2, 8, 20])
@pytest.mark.parametrize("shift", [1.0, 0.5, 3.0])
def test_sigma_grid_endpoints_and_monotone(num_denoising_steps, shift):
    sigmas = flow.sigma_grid(num_denoising_steps, shift)
    assert sigmas.shape == (num_denoising_steps + 1,)
    assert sigmas.dtype == torch.float32
    assert sigmas[0].item() == 1.0
    assert sigmas[-1].item() == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()


def test_sigma_grid_uniform_without_shift():
    expected = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    assert torch.equal(flow.sigma_grid(4, dtype=torch.float64), expected)


def test_sigma_grid_shift_matches_hand_computed_values():
    # s * sigma / (1 + (s - 1) * sigma) on the uniform grid 1, 3/4, 1/2, 1/4, 0.
    shift_three = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0], dtype=torch.float64)
    shift_half = torch.tensor([1.0, 0.6, 1 / 3, 1 / 7, 0.0], dtype=torch.float64)
    torch.testing.assert_close(flow.sigma_grid(4, 3.0, dtype=torch.float64), shift_three)
    torch.testing.assert_close(flow.sigma_grid(4, 0.5, dtype=torch.float64), shift_half)
    # shift > 1 spends more of the grid at high noise.
    assert (flow.sigma_grid(10, 3.0)[1:-1] > flow.sigma_grid(10)[1:-1]).all()


@pytest.mark.parametrize("shift", [0.0, -1.0])
def test_sigma_grid_rejects_non_positive_shift(shift):
    with pytest.raises(ValueError, match="shift"):
        flow.sigma_grid(8, shift)


def test_sigma_grid_rejects_zero_steps():
    with pytest.raises(ValueError, match="num_denoising_steps"):
        flow.sigma_grid(0)


# --------------------------------------------------------------------------- noise schedule
def test_noise_std_scale_sqrt_schedule_closed_form():
    sigma = torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=torch.float64)
    expected = 0.2 * torch.sqrt(sigma / (1 - sigma))
    torch.testing.assert_close(flow.noise_std_scale(sigma, 0.2), expected)
    assert flow.noise_std_scale(torch.tensor([0.5]), 0.5).item() == pytest.approx(0.5)


@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
def test_noise_std_scale_clamps_one_minus_sigma(noise_level):
    sigma = torch.tensor([1.0, 1.0 - 5e-4], dtype=torch.float64)
    scale = flow.noise_std_scale(sigma, noise_level)
    assert torch.isfinite(scale).all()
    assert scale[0].item() == pytest.approx(noise_level * math.sqrt(1.0 / 1e-3), rel=1e-12)
    assert scale[1].item() == pytest.approx(noise_level * math.sqrt((1 - 5e-4) / 1e-3), rel=1e-9)
    # Just above the clamp the formula is unclamped.
    above = torch.tensor([1.0 - 2e-3], dtype=torch.float64)
    unclamped = noise_level * math.sqrt((1 - 2e-3) / 2e-3)
    assert flow.noise_std_scale(above, noise_level).item() == pytest.approx(unclamped, rel=1e-9)


def test_noise_std_scale_constant_schedule():
    sigma = torch.linspace(0, 1, 7)
    assert torch.equal(flow.noise_std_scale(sigma, 0.3, "constant"), torch.full((7,), 0.3))


def test_noise_std_scale_errors():
    with pytest.raises(ValueError, match="noise_level"):
        flow.noise_std_scale(torch.tensor([0.5]), -0.1)
    with pytest.raises(ValueError, match="noise_schedule"):
        flow.noise_std_scale(torch.tensor([0.5]), 0.5, "cosine")


# --------------------------------------------------------------------------- SDE step
def _reference_sde_step(x, velocity, sigma, sigma_next, noise_level):
    """DESIGN.md section 1, written out term by term."""
    step_size = sigma_next - sigma
    one_minus_sigma = max(1.0 - sigma, 1e-3)
    g = noise_level * math.sqrt(sigma / one_minus_sigma)
    correction = noise_level**2 / (2 * one_minus_sigma) * (x + (1 - sigma) * velocity)
    mean = x + (velocity + correction) * step_size
    return mean, g * math.sqrt(abs(step_size))


@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
@pytest.mark.parametrize(("sigma", "sigma_next"), [(0.875, 0.75), (0.5, 0.25), (0.125, 0.0)])
def test_sde_step_matches_design_formula(noise_level, sigma, sigma_next):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 2, generator=generator, dtype=torch.float64)
    velocity = torch.randn(5, 3, 2, generator=generator, dtype=torch.float64)
    mean, std = flow.sde_step(
        x,
        velocity,
        torch.tensor(sigma, dtype=torch.float64),
        torch.tensor(sigma_next, dtype=torch.float64),
        noise_level,
    )
    expected_mean, expected_std = _reference_sde_step(x, velocity, sigma, sigma_next, noise_level)
    torch.testing.assert_close(mean, expected_mean)
    assert std.item() == pytest.approx(expected_std, rel=1e-12)


def test_sde_step_hand_computed_example():
    # a = 0.5, sigma = 0.5 -> 0.25, x = 0, v = 1: c = a^2 / (2 * 0.5) = 0.25,
    # drift = 1 + 0.25 * (0 + 0.5 * 1) = 1.125, mean = -0.25 * 1.125, std = 0.5 * 1 * 0.5.
    mean, std = flow.sde_step(
        torch.zeros(2, 3), torch.ones(2, 3), torch.tensor(0.5), torch.tensor(0.25), 0.5
    )
    torch.testing.assert_close(mean, torch.full((2, 3), -0.28125))
    assert std.item() == pytest.approx(0.25)


def test_sde_step_constant_schedule_closed_form():
    x, velocity = torch.full((1, 2), 0.4), torch.full((1, 2), -0.6)
    sigma, sigma_next, a = torch.tensor(0.5), torch.tensor(0.25), 0.3
    mean, std = flow.sde_step(x, velocity, sigma, sigma_next, a, "constant")
    # g = a, drift coefficient g^2 / (2 sigma) = 0.09.
    expected = 0.4 + (-0.6 + 0.09 * (0.4 + 0.5 * -0.6)) * -0.25
    torch.testing.assert_close(mean, torch.full((1, 2), expected))
    assert std.item() == pytest.approx(0.3 * 0.5)


def test_sde_step_rejects_negative_noise_level():
    with pytest.raises(ValueError, match="noise_level"):
        flow.sde_step(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor(0.5), torch.tensor(0.25), -1
        )


@pytest.mark.parametrize("num_denoising_steps", [2, 8, 20])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_zero_noise_sde_step_is_exactly_the_euler_step(num_denoising_steps, shift):
    sigmas = flow.sigma_grid(num_denoising_steps, shift)
    generator = torch.Generator().manual_seed(1)
    for k in range(num_denoising_steps):
        x = torch.randn(4, 3, 2, generator=generator)
        velocity = torch.randn(4, 3, 2, generator=generator)
        mean, std = flow.sde_step(x, velocity, sigmas[k], sigmas[k + 1], 0.0)
        assert torch.equal(mean, flow.ode_step(x, velocity, sigmas[k], sigmas[k + 1]))
        assert torch.equal(mean, x + velocity * (sigmas[k + 1] - sigmas[k]))
        assert std.item() == 0.0


@pytest.mark.parametrize("schedule", ["sqrt", "constant"])
@pytest.mark.parametrize("noise_level", [0.0, 0.5])
def test_step_coefficients_agree_with_sde_step(schedule, noise_level):
    sigmas = flow.sigma_grid(8, 2.0, dtype=torch.float64)
    x_coefficient, velocity_coefficient, std = flow.step_coefficients(sigmas, noise_level, schedule)
    assert x_coefficient.shape == velocity_coefficient.shape == std.shape == (8,)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3, 2, generator=generator, dtype=torch.float64)
    velocity = torch.randn(8, 3, 2, generator=generator, dtype=torch.float64)
    for k in range(8):
        mean, expected_std = flow.sde_step(
            x[k], velocity[k], sigmas[k], sigmas[k + 1], noise_level, schedule
        )
        affine = x_coefficient[k] * x[k] + velocity_coefficient[k] * velocity[k]
        torch.testing.assert_close(affine, mean)
        torch.testing.assert_close(std[k], expected_std)


def test_step_coefficients_zero_noise_is_euler():
    sigmas = flow.sigma_grid(5, 3.0)
    x_coefficient, velocity_coefficient, std = flow.step_coefficients(sigmas, 0.0)
    assert torch.equal(x_coefficient, torch.ones(5))
    assert torch.equal(velocity_coefficient, sigmas[1:] - sigmas[:-1])
    assert torch.equal(std, torch.zeros(5))


def test_step_coefficients_std_is_parameter_free():
    # The grid has no parameters, so neither does std: the gradient flows through the mean.
    _, _, std = flow.step_coefficients(flow.sigma_grid(8), 0.5)
    assert not std.requires_grad and std.grad_fn is None
    x = torch.randn(2, 3, requires_grad=True)
    velocity = torch.randn(2, 3, requires_grad=True)
    mean, std = flow.sde_step(x, velocity, torch.tensor(0.5), torch.tensor(0.375), 0.5)
    assert mean.requires_grad
    assert not std.requires_grad


@pytest.mark.parametrize("schedule", ["sqrt", "constant"])
@pytest.mark.parametrize(("sigma", "sigma_next"), [(0.875, 0.75), (0.25, 0.0), (1.0, 0.875)])
def test_sde_mean_gradcheck(schedule, sigma, sigma_next):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    velocity = torch.randn(2, 3, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    sigma_t = torch.tensor(sigma, dtype=torch.float64)
    sigma_next_t = torch.tensor(sigma_next, dtype=torch.float64)

    def mean(x, velocity):
        return flow.sde_step(x, velocity, sigma_t, sigma_next_t, 0.6, schedule)[0]

    assert torch.autograd.gradcheck(mean, (x, velocity))


# --------------------------------------------------------------------------- log-prob
@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)])
def test_gaussian_log_prob_matches_torch_normal(batch_shape):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(*batch_shape, 5, 3, generator=generator)
    mean = torch.randn(*batch_shape, 5, 3, generator=generator)
    std = torch.rand(batch_shape, generator=generator) + 0.1
    log_prob = flow.gaussian_log_prob(x, mean, std)
    expected = Normal(mean, std[..., None, None].expand_as(mean)).log_prob(x).sum((-2, -1))
    assert log_prob.shape == batch_shape
    torch.testing.assert_close(log_prob, expected)


def test_gaussian_log_prob_event_dims():
    x, mean, std = torch.randn(4, 6), torch.randn(4, 6), torch.rand(4) + 0.5
    expected = Normal(mean, std[:, None].expand_as(mean)).log_prob(x).sum(-1)
    torch.testing.assert_close(flow.gaussian_log_prob(x, mean, std, event_dims=1), expected)
    # event_dims = 2 on a [4, 6] input: one event of 24 values with a scalar std.
    scalar = torch.tensor(0.7)
    expected = Normal(mean, scalar).log_prob(x).sum()
    torch.testing.assert_close(flow.gaussian_log_prob(x, mean, scalar), expected)


def test_gaussian_log_prob_dtype():
    x = torch.randn(3, 4, 2)
    std = torch.full((3,), 0.5)
    low = flow.gaussian_log_prob(x.bfloat16(), torch.zeros(3, 4, 2).bfloat16(), std.bfloat16())
    assert low.dtype == torch.float32
    double = flow.gaussian_log_prob(x.double(), torch.zeros(3, 4, 2).double(), std.double())
    assert double.dtype == torch.float64
    assert flow.probability_dtype(torch.bfloat16) == torch.float32
    assert flow.probability_dtype(torch.float16) == torch.float32
    assert flow.probability_dtype(torch.float64) == torch.float64


# --------------------------------------------------------------------------- SDE mask
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_denoising_steps", [2, 5, 8])
def test_step_zero_is_never_stochastic(mode, num_denoising_steps):
    generator = torch.Generator().manual_seed(5)
    mask = flow.sample_sde_mask(
        (4000,), num_denoising_steps, mode, num_sde_steps=1, generator=generator
    )
    assert mask.shape == (4000, num_denoising_steps) and mask.dtype == torch.bool
    assert not mask[:, 0].any()


def test_mixed_mask_draws_one_step_uniformly_from_one_to_k_minus_one():
    num_denoising_steps, draws = 8, 14000
    generator = torch.Generator().manual_seed(6)
    mask = flow.sample_sde_mask((draws,), num_denoising_steps, "mixed", generator=generator)
    assert torch.equal(mask.sum(-1), torch.ones(draws, dtype=torch.long))
    counts = mask.sum(0).double()
    assert counts[0] == 0
    expected = draws / (num_denoising_steps - 1)
    standard_error = math.sqrt(expected * (1 - 1 / (num_denoising_steps - 1)))
    assert ((counts[1:] - expected).abs() < 4 * standard_error).all(), counts


def test_last_and_all_masks():
    last = flow.sample_sde_mask((2, 3), 8, "last", num_sde_steps=3)
    expected = torch.tensor([False] * 5 + [True] * 3).expand(2, 3, 8)
    assert torch.equal(last, expected)
    every = flow.sample_sde_mask((), 6, "all")
    assert torch.equal(every, torch.tensor([False] + [True] * 5))


def test_mixed_mask_is_seeded():
    first = flow.sample_sde_mask((64,), 8, generator=torch.Generator().manual_seed(7))
    second = flow.sample_sde_mask((64,), 8, generator=torch.Generator().manual_seed(7))
    other = flow.sample_sde_mask((64,), 8, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_mask_errors():
    with pytest.raises(ValueError, match="num_denoising_steps"):
        flow.sample_sde_mask((1,), 1, "mixed")
    with pytest.raises(ValueError, match="num_denoising_steps"):
        flow.sample_sde_mask((1,), 1, "all")
    with pytest.raises(ValueError, match="num_sde_steps"):
        flow.sample_sde_mask((1,), 8, "last", num_sde_steps=8)
    with pytest.raises(ValueError, match="num_sde_steps"):
        flow.sample_sde_mask((1,), 8, "last", num_sde_steps=0)
    with pytest.raises(ValueError, match="sde_mode"):
        flow.sample_sde_mask((1,), 8, "first")


# --------------------------------------------------------------------------- interpolant, score
def test_interpolant_endpoints_and_velocity():
    generator = torch.Generator().manual_seed(9)
    action = torch.randn(6, 3, 2, generator=generator, dtype=torch.float64)
    noise = torch.randn(6, 3, 2, generator=generator, dtype=torch.float64)
    ones, zeros = torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    assert torch.equal(flow.interpolate(action, noise, ones), noise)
    assert torch.equal(flow.interpolate(action, noise, zeros), action)
    # d x_sigma / d sigma = noise - action: the regression target.
    sigma = torch.rand(6, generator=generator, dtype=torch.float64) * 0.8 + 0.1
    step = 1e-6
    derivative = (
        flow.interpolate(action, noise, sigma + step)
        - flow.interpolate(action, noise, sigma - step)
    ) / (2 * step)
    torch.testing.assert_close(derivative, flow.velocity_target(action, noise))


def test_score_matches_gaussian_closed_form(gaussian_velocity):
    velocity = gaussian_velocity.double()
    generator = torch.Generator().manual_seed(10)
    for sigma in (0.9, 0.5, 0.1):
        x = torch.randn(7, 2, 2, generator=generator, dtype=torch.float64)
        sigma_t = torch.full((7,), sigma, dtype=torch.float64)
        marginal_mean, marginal_variance = velocity.marginal(torch.tensor(sigma).double())
        expected = -(x - marginal_mean) / marginal_variance
        torch.testing.assert_close(flow.score(x, velocity(x, sigma_t), sigma), expected)


# --------------------------------------------------------------------------- marginals
def _linear_velocity(velocity_field, sigma):
    """The Gaussian velocity is affine in x: ``v = slope * x + intercept`` (per coordinate)."""
    zero = velocity_field(torch.zeros(1, 2, 2, dtype=torch.float64), sigma.reshape(1))[0]
    one = velocity_field(torch.ones(1, 2, 2, dtype=torch.float64), sigma.reshape(1))[0]
    return one - zero, zero


def _exact_chain_moments(
    velocity_field, num_denoising_steps, noise_level, mask, drop_correction=False
):
    """Mean and variance of x_K, propagated exactly through the affine-Gaussian recursion.

    ``mask [M, K]`` holds ``M`` stochastic-step patterns, each used with equal probability;
    the moments of the resulting mixture are returned.
    """
    sigmas = flow.sigma_grid(num_denoising_steps, dtype=torch.float64)
    x_coefficient, velocity_coefficient, std = flow.step_coefficients(sigmas, noise_level)
    step_size = sigmas[1:] - sigmas[:-1]
    if drop_correction:
        x_coefficient, velocity_coefficient = torch.ones_like(step_size), step_size
    mean = torch.zeros(mask.shape[0], 2, 2, dtype=torch.float64)
    variance = torch.ones(mask.shape[0], 2, 2, dtype=torch.float64)
    for k in range(num_denoising_steps):
        slope, intercept = _linear_velocity(velocity_field, sigmas[k])
        stochastic = mask[:, k, None, None]
        alpha = torch.where(
            stochastic, x_coefficient[k] + velocity_coefficient[k] * slope, 1 + step_size[k] * slope
        )
        beta = torch.where(stochastic, velocity_coefficient[k], step_size[k]) * intercept
        mean = alpha * mean + beta
        variance = alpha**2 * variance + torch.where(stochastic, std[k] ** 2, 0.0)
    mixture_mean = mean.mean(0)
    return mixture_mean, variance.mean(0) + (mean - mixture_mean).pow(2).mean(0)


def _masks(mode, num_denoising_steps):
    steps = torch.arange(num_denoising_steps)
    if mode == "ode":
        return torch.zeros(1, num_denoising_steps, dtype=torch.bool)
    if mode == "all":
        return (steps >= 1)[None]
    return steps[None] == torch.arange(1, num_denoising_steps)[:, None]  # mixed: every k* in 1..K-1


@pytest.mark.parametrize("num_denoising_steps", [100, 200])
@pytest.mark.parametrize("mode", ["ode", "all", "mixed"])
@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
def test_exact_discretisation_error_is_first_order(
    gaussian_velocity, num_denoising_steps, mode, noise_level
):
    """Pins the ``5 / K`` allowance of the sampled moment checks to the exact Euler error."""
    velocity = gaussian_velocity.double()
    mean, variance = _exact_chain_moments(
        velocity,
        num_denoising_steps,
        0.0 if mode == "ode" else noise_level,
        _masks(mode, num_denoising_steps),
    )
    torch.testing.assert_close(mean, velocity.mean, atol=1e-9, rtol=0)
    relative_error = (variance / velocity.std**2 - 1).abs()
    assert (relative_error < 5.0 / num_denoising_steps).all(), relative_error


@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
def test_exact_moments_expose_a_drift_without_score_correction(gaussian_velocity, noise_level):
    """In "all" mode, dropping the score term inflates the variance by far more than 5 / K."""
    velocity, num_denoising_steps = gaussian_velocity.double(), 200
    _, variance = _exact_chain_moments(
        velocity,
        num_denoising_steps,
        noise_level,
        _masks("all", num_denoising_steps),
        drop_correction=True,
    )
    assert ((variance / velocity.std**2 - 1) > 0.2).all(), variance / velocity.std**2


def _sample_sde(
    velocity,
    num_denoising_steps,
    noise_level,
    num_samples,
    *,
    mode="all",
    schedule="sqrt",
    drop_correction=False,
    seed=0,
):
    """Sample x_K with flow.sde_step / flow.ode_step in a plain loop."""
    generator = torch.Generator().manual_seed(seed)
    sigmas = flow.sigma_grid(num_denoising_steps)
    x = torch.randn(num_samples, 2, 2, generator=generator)
    mask = flow.sample_sde_mask((num_samples,), num_denoising_steps, mode, generator=generator)
    for k in range(num_denoising_steps):
        v = velocity(x, sigmas[k].expand(num_samples))
        ode = flow.ode_step(x, v, sigmas[k], sigmas[k + 1])
        if not mask[:, k].any():
            x = ode
            continue
        mean, std = flow.sde_step(x, v, sigmas[k], sigmas[k + 1], noise_level, schedule)
        if drop_correction:
            mean = ode
        sde = mean + std * torch.randn(x.shape, generator=generator)
        x = torch.where(mask[:, k, None, None], sde, ode)
    return x


@pytest.mark.parametrize("schedule", ["sqrt", "constant"])
@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
def test_sde_loop_preserves_gaussian_marginals(
    gaussian_velocity, check_gaussian_moments, noise_level, schedule
):
    num_denoising_steps = 200
    samples = _sample_sde(
        gaussian_velocity, num_denoising_steps, noise_level, 20000, schedule=schedule
    )
    check_gaussian_moments(
        samples, gaussian_velocity.mean, gaussian_velocity.std, num_denoising_steps
    )


def test_ode_loop_preserves_gaussian_marginals(gaussian_velocity, check_gaussian_moments):
    samples = _sample_sde(gaussian_velocity, 200, 0.0, 20000)
    check_gaussian_moments(samples, gaussian_velocity.mean, gaussian_velocity.std, 200)


@pytest.mark.parametrize("noise_level", [0.2, 0.5, 0.8])
def test_moment_check_rejects_drift_without_score_correction(
    gaussian_velocity, check_gaussian_moments, noise_level
):
    samples = _sample_sde(gaussian_velocity, 200, noise_level, 20000, drop_correction=True)
    with pytest.raises(AssertionError):
        check_gaussian_moments(samples, gaussian_velocity.mean, gaussian_velocity.std, 200)


# ---------------------------------------------------------------------------- the sampler loop
def test_integrate_ode_with_constant_velocity_is_the_closed_form():
    schedule = flow.sampling_schedule(5, noise_level=0.5, shift=3.0)
    x0 = torch.randn(4, 3, 2, dtype=torch.float64)
    velocity = torch.randn(3, 2, dtype=torch.float64)
    chain, means, _ = flow.integrate(lambda x, sigma: velocity.expand_as(x), x0, schedule)
    assert means is None and chain.shape == (4, 6, 3, 2)
    sigmas = schedule.sigmas.to(torch.float64)
    for k in range(6):  # x_k = x_0 + (sigma_k - 1) v
        torch.testing.assert_close(chain[:, k], x0 + (sigmas[k] - 1.0) * velocity)


def test_integrate_with_a_mask_is_the_affine_sde_step_at_stochastic_steps_only():
    torch.manual_seed(0)
    num_denoising_steps, noise_level = 4, 0.7
    schedule = flow.sampling_schedule(num_denoising_steps, noise_level, dtype=torch.float64)
    weight = torch.randn(2, 2, dtype=torch.float64)

    def velocity(x, sigma):
        return x @ weight + sigma[:, None, None]

    x0 = torch.randn(3, 5, 2, dtype=torch.float64)
    mask = flow.sample_sde_mask((3,), num_denoising_steps, "mixed")
    xi = torch.randn(3, num_denoising_steps, 5, 2, dtype=torch.float64)
    chain, means, _ = flow.integrate(velocity, x0, schedule, mask, xi)
    sigmas = schedule.sigmas
    for n in range(3):
        x = x0[n]
        for k in range(num_denoising_steps):
            v = velocity(x[None], sigmas[k : k + 1])[0]
            if mask[n, k]:
                mean, std = flow.sde_step(x, v, sigmas[k], sigmas[k + 1], noise_level)
                x = mean + std * xi[n, k]
            else:
                mean = flow.ode_step(x, v, sigmas[k], sigmas[k + 1])
                x = mean
            torch.testing.assert_close(means[n, k], mean)
            torch.testing.assert_close(chain[n, k + 1], x)
    # The mask off everywhere gives the ODE chain, whatever the noise.
    ode, _, _ = flow.integrate(velocity, x0, schedule)
    no_steps, _, _ = flow.integrate(velocity, x0, schedule, torch.zeros_like(mask), xi)
    assert torch.equal(ode, no_steps)


def test_integrate_names_the_first_non_finite_step():
    schedule = flow.sampling_schedule(4, 0.0)

    def velocity(x, sigma):
        return torch.where(sigma[:, None, None] < 0.6, torch.inf, 1.0) * torch.ones_like(x)

    with pytest.raises(ValueError, match="denoising step 2 .*x_3 is not finite"):
        flow.integrate(velocity, torch.zeros(2, 3, 1), schedule)


def test_stochastic_steps_rescore_a_stored_chain_and_chain_log_prob_matches():
    torch.manual_seed(1)
    schedule = flow.sampling_schedule(4, 0.5, dtype=torch.float64)
    context = torch.randn(6, 3, 2, dtype=torch.float64)

    def velocity(x, sigma, index=None):
        return x - (context if index is None else context[index])

    mask = flow.sample_sde_mask((6,), 4, "last", num_sde_steps=2)
    chain, means, _ = flow.integrate(
        velocity,
        torch.randn(6, 3, 2, dtype=torch.float64),
        schedule,
        mask,
        torch.randn(6, 4, 3, 2, dtype=torch.float64),
    )
    steps = flow.stochastic_steps(velocity, chain, mask, schedule, rows=2)
    assert steps.step_index.tolist() == [2, 3] * 6
    torch.testing.assert_close(steps.mean, means[mask][:, :2])
    torch.testing.assert_close(steps.sample, chain[:, 1:][mask][:, :2])
    log_prob = flow.gaussian_log_prob(steps.sample, steps.mean, steps.std)
    dense = flow.scatter_steps(steps, log_prob, torch.Size([6, 4]))
    torch.testing.assert_close(dense, flow.chain_log_prob(chain, means, mask, schedule.std, 2))
    assert (dense[~mask] == 0).all() and (dense[mask] != 0).all()


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"noise_level": -0.1}, "noise_level"),
        ({"noise_schedule": "cosine"}, "noise_schedule"),
        ({"num_denoising_steps": 1}, "num_denoising_steps >= 2"),
        ({"sde_mode": "last", "num_sde_steps": 8}, "num_sde_steps"),
        ({"shift": 0.0}, "shift"),
    ],
)
def test_check_sampler_names_the_bad_argument(arguments, match):
    options = {"num_denoising_steps": 8, "noise_level": 0.5} | arguments
    with pytest.raises(ValueError, match=match):
        flow.check_sampler(**options)
