"""The Flow-SDE step: sigma grid, diffusion coefficient, Gaussian transition, stochastic steps;
the check of the sampler's settings (:func:`check_sampler`).

Pure tensor functions (see :mod:`torchrl_flowpolicy.flow` for the time convention and the
symbol table); each is tested against its closed form.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "NoiseSchedule",
    "SDEMode",
    "SIGMA_CLAMP",
    "check_integer",
    "check_noise_level",
    "check_noise_scale",
    "probability_dtype",
    "sigma_grid",
    "noise_std_scale",
    "score",
    "step_coefficients",
    "ode_step",
    "sde_step",
    "sample_sde_mask",
    "MAX_STEP_X_COEFFICIENT",
    "check_sampler",
]

NoiseSchedule = Literal["sqrt", "constant"]
SDEMode = Literal["mixed", "last", "all"]

#: Lower bound on ``1 - sigma`` in the ``"sqrt"`` schedule, where ``g`` diverges at sigma = 1.
SIGMA_CLAMP = 1e-3


def check_integer(name: str, value: object, minimum: int) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is an integer ``>= minimum``.

    Python and NumPy integers count; floats (even ``8.0``), booleans and tensors do not.

    Examples:
        >>> check_integer("num_denoising_steps", 8, 1)  # valid: returns None
        >>> check_integer("num_denoising_steps", 2.5, 1)
        Traceback (most recent call last):
        ...
        ValueError: num_denoising_steps must be an integer >= 1, got 2.5.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def check_noise_level(noise_level: object) -> None:
    """Raise a ``ValueError`` unless ``noise_level`` (``a``) is a finite number ``>= 0``."""
    if not (
        isinstance(noise_level, numbers.Real)
        and not isinstance(noise_level, bool)
        and math.isfinite(noise_level)
        and noise_level >= 0
    ):
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level!r}.")


def check_noise_scale(name: str, value: object) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a finite number ``>= 0``.

    The scale of an initial noise ``x_0`` (``rollout_noise_scale``, ``eval_noise_scale``).

    Examples:
        >>> check_noise_scale("eval_noise_scale", -1.0)
        Traceback (most recent call last):
        ...
        ValueError: eval_noise_scale must be a finite number >= 0, got -1.0.
    """
    if not (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")


def probability_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the probability path for a network running in ``dtype``.

    The chain, the Gaussian means and the log-probabilities are kept in float32 or wider,
    even when the velocity network runs in bfloat16 or float16.

    Examples:
        >>> probability_dtype(torch.bfloat16), probability_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(dtype, torch.float32)


def sigma_grid(
    num_denoising_steps: int,
    shift: float = 1.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The noise levels ``sigma_0 = 1 > sigma_1 > ... > sigma_K = 0``.

    The grid is uniform, ``1 - k / K``, followed by the time shift
    ``sigma' = s * sigma / (1 + (s - 1) * sigma)`` (``s = 1``: no shift; ``s > 1`` spends
    more steps at high noise, as in Stable Diffusion 3 and Fast-WAM).

    Args:
        num_denoising_steps: the number of denoising steps ``K`` (an integer >= 1).
        shift: the shift ``s`` (finite, > 0).
        dtype: dtype of the returned grid.
        device: device of the returned grid.

    Returns:
        A tensor of shape ``[K + 1]``.

    Raises:
        ValueError: a bad ``num_denoising_steps`` or ``shift``, or a grid that is not strictly
            decreasing in ``dtype`` (a large shift puts ``sigma_1`` within rounding of 1:
            ``shift=1e8`` at ``K = 8`` in float32).

    Examples:
        >>> sigma_grid(4)
        tensor([1.0000, 0.7500, 0.5000, 0.2500, 0.0000])
    """
    check_integer("num_denoising_steps", num_denoising_steps, 1)
    if not (isinstance(shift, numbers.Real) and math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift must be a finite number > 0 (1.0 means no shift), got {shift!r}.")
    sigma = 1.0 - torch.arange(num_denoising_steps + 1, dtype=torch.float64) / num_denoising_steps
    sigma = shift * sigma / (1.0 + (shift - 1.0) * sigma)
    grid = sigma.to(dtype=dtype)
    if torch.compiler.is_compiling():
        # A pure function of the options, checked when they were set (check_sampler builds
        # this grid): under torch.compile the data-dependent check would break the graph.
        return grid.to(device=device)
    # Two equal levels would make a zero step: std 0, a NaN log-probability.
    equal = (grid[1:] >= grid[:-1]).nonzero()
    if equal.numel():
        step = int(equal[0])
        raise ValueError(
            f"shift={shift:g} collapses the sigma grid of num_denoising_steps={num_denoising_steps} in {dtype}: "
            f"sigma_{step} and sigma_{step + 1} are both {float(grid[step])!r} (a zero step, "
            f"whose std is 0 and log-probability NaN). Use a smaller shift, fewer steps or a "
            f"wider dtype."
        )
    return grid.to(device=device)


def noise_std_scale(sigma: Tensor, noise_level: float, schedule: NoiseSchedule = "sqrt") -> Tensor:
    """The diffusion coefficient ``g(sigma)`` of the Flow-SDE.

    ``"sqrt"``: ``g = a * sqrt(sigma / (1 - sigma))`` (Flow-GRPO, pi-RL), with
    ``1 - sigma`` clamped to at least :data:`SIGMA_CLAMP`. ``"constant"``: ``g = a``.

    Examples:
        >>> noise_std_scale(torch.tensor([0.5]), 0.5)
        tensor([0.5000])
    """
    check_noise_level(noise_level)
    if schedule == "sqrt":
        return noise_level * torch.sqrt(sigma / (1.0 - sigma).clamp_min(SIGMA_CLAMP))
    if schedule == "constant":
        return torch.full_like(sigma, noise_level)
    raise ValueError(f"noise_schedule must be 'sqrt' or 'constant', got {schedule!r}.")


def score(x: Tensor, velocity: Tensor, sigma: Tensor | float) -> Tensor:
    """The score ``grad_x log p_sigma(x) = -(x + (1 - sigma) * v) / sigma``.

    Follows from ``x = (1 - sigma) * action + sigma * noise`` and ``v = noise - action``:
    ``E[noise | x] = x + (1 - sigma) * v`` and, for a Gaussian noise,
    ``grad log p_sigma(x) = -E[noise | x] / sigma`` (Tweedie).

    Args:
        x: the noisy sample, ``[..., H, D]``.
        velocity: the velocity at ``(x, sigma)``, same shape.
        sigma: the noise level, broadcastable to ``x`` (> 0).
    """
    return -(x + (1.0 - sigma) * velocity) / sigma


def _drift_coefficient(sigma: Tensor, noise_level: float, schedule: NoiseSchedule) -> Tensor:
    """``g(sigma)^2 / (2 sigma)``: the weight of ``x + (1 - sigma) v`` in the SDE drift."""
    if schedule == "sqrt":
        # g^2 / (2 sigma) = a^2 / (2 (1 - sigma)): finite at sigma = 0.
        return noise_level**2 / (2.0 * (1.0 - sigma).clamp_min(SIGMA_CLAMP))
    if schedule == "constant":
        return noise_level**2 / (2.0 * sigma)
    raise ValueError(f"noise_schedule must be 'sqrt' or 'constant', got {schedule!r}.")


def step_coefficients(
    sigmas: Tensor, noise_level: float, schedule: NoiseSchedule = "sqrt"
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-step coefficients of the Flow-SDE step, written as an affine map.

    The Flow-SDE mean is linear in ``x_k`` and ``v_k``:
    ``mean_k = x_k + [v_k + c_k (x_k + (1 - sigma_k) v_k)] Delta_k
    = (1 + c_k Delta_k) x_k + Delta_k (1 + c_k (1 - sigma_k)) v_k``
    with ``c_k = g_k^2 / (2 sigma_k)``, and ``std_k = g_k sqrt(|Delta_k|)``. With
    ``noise_level = 0`` the coefficients are exactly ``(1, Delta_k, 0)``: the Euler step.

    Args:
        sigmas: the grid, ``[K + 1]``.
        noise_level: ``a`` (>= 0).
        schedule: ``"sqrt"`` or ``"constant"``.

    Returns:
        ``(x_coefficient, velocity_coefficient, std)``, each of shape ``[K]``.

    Examples:
        >>> x_coef, v_coef, std = step_coefficients(sigma_grid(2), 0.0)
        >>> x_coef, v_coef, std
        (tensor([1., 1.]), tensor([-0.5000, -0.5000]), tensor([0., 0.]))
    """
    sigma, sigma_next = sigmas[:-1], sigmas[1:]
    step_size = sigma_next - sigma
    if noise_level == 0:
        return torch.ones_like(sigma), step_size, torch.zeros_like(sigma)
    drift = _drift_coefficient(sigma, noise_level, schedule)
    x_coefficient = 1.0 + drift * step_size
    velocity_coefficient = step_size * (1.0 + drift * (1.0 - sigma))
    std = noise_std_scale(sigma, noise_level, schedule) * step_size.abs().sqrt()
    return x_coefficient, velocity_coefficient, std


def ode_step(x: Tensor, velocity: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """One Euler step of the probability-flow ODE: ``x + v * (sigma_next - sigma)``."""
    return x + velocity * (sigma_next - sigma)


def sde_step(
    x: Tensor,
    velocity: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    noise_level: float,
    schedule: NoiseSchedule = "sqrt",
) -> tuple[Tensor, Tensor]:
    """The Gaussian transition ``x_{k+1} ~ N(mean, std^2 I)`` of one Flow-SDE step.

    Implements (seed chapter 5.2; Flow-GRPO eq. 12; pi-RL Flow-SDE):
    ``g = a sqrt(sigma / (1 - sigma))``,
    ``mean = x + [v + g^2 / (2 sigma) (x + (1 - sigma) v)] Delta``,
    ``std = g sqrt(|Delta|)``.

    Args:
        x: ``x_k``, ``[..., H, D]``.
        velocity: ``v(x_k, sigma_k)``, same shape.
        sigma: ``sigma_k``, broadcastable to ``x`` (a tensor).
        sigma_next: ``sigma_{k+1}``, same shape as ``sigma``.
        noise_level: ``a`` (>= 0); 0 gives the Euler ODE step and ``std = 0``.
        schedule: ``"sqrt"`` (default) or ``"constant"`` (``g = a``).

    Returns:
        ``(mean, std)``; ``std`` has the shape of ``sigma``.

    Examples:
        >>> x, v = torch.zeros(2, 3), torch.ones(2, 3)
        >>> mean, std = sde_step(x, v, torch.tensor(0.5), torch.tensor(0.25), 0.5)
        >>> mean[0, 0].item(), round(std.item(), 4)
        (-0.28125, 0.25)
    """
    check_noise_level(noise_level)
    step_size = sigma_next - sigma
    drift = velocity + _drift_coefficient(sigma, noise_level, schedule) * (
        x + (1.0 - sigma) * velocity
    )
    mean = x + drift * step_size
    std = noise_std_scale(sigma, noise_level, schedule) * step_size.abs().sqrt()
    return mean, std


def sample_sde_mask(
    batch_shape: tuple[int, ...] | torch.Size,
    num_denoising_steps: int,
    mode: SDEMode = "mixed",
    num_sde_steps: int = 4,
    *,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Which denoising steps are stochastic, ``[*batch_shape, K]`` booleans.

    Step 0 (sigma = 1) is never stochastic.

    * ``"mixed"``: one step ``k*`` drawn uniformly from ``1..K-1`` per sample (pi-RL's
      mixed ODE-SDE sampler); needs ``K >= 2``.
    * ``"last"``: the last ``num_sde_steps`` steps, ``K - n .. K - 1`` (needs ``n <= K - 1``).
    * ``"all"``: steps ``1..K-1``.

    Examples:
        >>> sample_sde_mask((2,), 4, "all")
        tensor([[False,  True,  True,  True],
                [False,  True,  True,  True]])
    """
    check_integer("num_denoising_steps", num_denoising_steps, 1)
    shape = tuple(batch_shape) + (num_denoising_steps,)
    steps = torch.arange(num_denoising_steps, device=device)
    if mode == "mixed":
        if num_denoising_steps < 2:
            raise ValueError(
                f"sde_mode='mixed' needs num_denoising_steps >= 2 (step 0 is never stochastic), "
                f"got num_denoising_steps={num_denoising_steps}."
            )
        chosen = torch.randint(
            1, num_denoising_steps, tuple(batch_shape) + (1,), device=device, generator=generator
        )
        return steps == chosen
    if mode == "last":
        check_integer("num_sde_steps", num_sde_steps, 1)
        if not 1 <= num_sde_steps <= num_denoising_steps - 1:
            raise ValueError(
                f"sde_mode='last' needs 1 <= num_sde_steps <= num_denoising_steps - 1 (step 0 is never "
                f"stochastic), got num_sde_steps={num_sde_steps}, num_denoising_steps={num_denoising_steps}."
            )
        return (steps >= num_denoising_steps - num_sde_steps).expand(shape)
    if mode == "all":
        if num_denoising_steps < 2:
            raise ValueError(
                f"sde_mode='all' needs num_denoising_steps >= 2, got {num_denoising_steps}."
            )
        return (steps >= 1).expand(shape)
    raise ValueError(f"sde_mode must be 'mixed', 'last' or 'all', got {mode!r}.")


#: The largest ``|x_coefficient_k|`` (the weight of ``x_k`` in a stochastic step's mean) that
#: :func:`check_sampler` accepts without a warning. Beyond 1 the step's score correction
#: ``c_k |Delta_k|`` exceeds 2: the mean overshoots the noise it removes, and a chain of such
#: steps explodes. On a uniform grid step 1 has ``x_coefficient = 1 - a^2 / 2`` whatever ``K``
#: (``a = noise_level``), so the limit is ``a = 2``.
MAX_STEP_X_COEFFICIENT = 1.0


def check_sampler(
    num_denoising_steps: int,
    noise_level: float,
    sde_mode: SDEMode = "mixed",
    num_sde_steps: int = 4,
    shift: float = 1.0,
    noise_schedule: NoiseSchedule = "sqrt",
    *,
    eval_num_denoising_steps: int | None = None,
    rollout_noise_scale: float = 1.0,
    eval_noise_scale: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Raise a ``ValueError`` naming the argument when the sampler's settings are invalid.

    The arguments are the fields of :class:`~torchrl_flowpolicy.sampler.SamplerOptions`
    (``check_sampler(**options.to_dict())``). Checks that the noise scales are finite and
    ``>= 0`` (:func:`~torchrl_flowpolicy.flow.check_noise_scale`), ``noise_level`` is finite
    and ``>= 0``, ``num_denoising_steps`` and ``num_sde_steps`` are integers that fit
    ``sde_mode``, ``shift`` is finite and ``> 0`` and the sigma grids (also that of
    ``eval_num_denoising_steps``, when given) are strictly decreasing in ``dtype`` (the chain's
    dtype). In ``"mixed"`` mode the check of ``sde_mode`` draws one mask from torch's global
    generator (:func:`~torchrl_flowpolicy.flow.sample_sde_mask`). Warns (``UserWarning``) when
    a step that ``sde_mode`` can make stochastic has ``|x_coefficient| >``
    :data:`MAX_STEP_X_COEFFICIENT` (see :func:`~torchrl_flowpolicy.flow.step_coefficients`):
    such a step overshoots, e.g. ``noise_level=5`` gives ``1 - 5^2 / 2 = -11.5`` at step 1 and
    actions in the thousands.

    Examples:
        >>> check_sampler(8, 0.5)  # valid: returns None
        >>> check_sampler(1, 0.5, "mixed")
        Traceback (most recent call last):
        ...
        ValueError: sde_mode='mixed' needs num_denoising_steps >= 2 (step 0 is never stochastic), got num_denoising_steps=1.
    """
    check_noise_scale("rollout_noise_scale", rollout_noise_scale)
    check_noise_scale("eval_noise_scale", eval_noise_scale)
    check_noise_level(noise_level)
    if noise_schedule not in ("sqrt", "constant"):
        raise ValueError(f"noise_schedule must be 'sqrt' or 'constant', got {noise_schedule!r}.")
    check_integer("num_denoising_steps", num_denoising_steps, 1)
    check_integer("num_sde_steps", num_sde_steps, 1)
    sample_sde_mask((1,), num_denoising_steps, sde_mode, num_sde_steps)  # sde_mode against K and n
    sigma_grid(num_denoising_steps, shift, dtype=dtype)  # shift > 0, strictly decreasing in dtype
    if eval_num_denoising_steps is not None:
        check_integer("eval_num_denoising_steps", eval_num_denoising_steps, 1)
        try:  # the shift is valid: only the grid can collapse
            sigma_grid(eval_num_denoising_steps, shift, dtype=dtype)
        except ValueError as error:
            steps = eval_num_denoising_steps
            raise ValueError(f"eval_num_denoising_steps={steps}: {error}") from None
    if noise_level == 0:
        return
    # Steps that sde_mode can make stochastic (step 0 never is).
    first = num_denoising_steps - num_sde_steps if sde_mode == "last" else 1
    sigmas = sigma_grid(num_denoising_steps, shift, dtype=torch.float64)
    x_coefficient = step_coefficients(sigmas, noise_level, noise_schedule)[0][first:]
    worst = int(x_coefficient.abs().argmax())
    coefficient = float(x_coefficient[worst])
    if abs(coefficient) > MAX_STEP_X_COEFFICIENT:
        step = first + worst
        warnings.warn(
            f"noise_level={noise_level!r} makes stochastic step {step} (sigma="
            f"{float(sigmas[step])!r}; num_denoising_steps={num_denoising_steps}, shift={shift:g}, "
            f"noise_schedule={noise_schedule!r}, sde_mode={sde_mode!r}) multiply x_k by "
            f"{coefficient:.4g} in its mean (|x_coefficient| > {MAX_STEP_X_COEFFICIENT:g}): the "
            f"step overshoots and the actions can explode. Lower noise_level (on a uniform "
            f"grid step 1 has 1 - noise_level^2 / 2, whatever num_denoising_steps) or use "
            f"sde_mode='last'.",
            UserWarning,
            stacklevel=3,
        )
