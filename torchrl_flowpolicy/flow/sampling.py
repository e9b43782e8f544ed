"""The sampler: one schedule, one integration loop, the log-probs of a sampled chain.

Every step of the mixed ODE/SDE sampler is the same affine update
``x_{k+1} = x_coefficient_k * x_k + velocity_coefficient_k * v_k + std_k * xi_k``: a
stochastic Flow-SDE step uses the coefficients of :func:`~torchrl_flowpolicy.flow.step_coefficients`,
a deterministic (Euler ODE) step uses ``(1, Delta_k, 0)``. :func:`integrate` runs that loop
for rollouts, evaluation and DSRL decoding; the learner's rescoring of stored chains is
:mod:`~torchrl_flowpolicy.flow.rescoring`.

The velocity is a callback ``velocity(x, sigma, ...) -> v`` on tensors
(:func:`network_velocity` makes one from a network, its context and dtypes), so this module
stays free of modules and TensorDicts.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from torchrl_flowpolicy.flow.gaussian import gaussian_log_prob
from torchrl_flowpolicy.flow.sde import (
    NoiseSchedule,
    SDEMode,
    check_integer,
    check_noise_level,
    check_noise_scale,
    sample_sde_mask,
    sigma_grid,
    step_coefficients,
)

__all__ = [
    "MAX_STEP_X_COEFFICIENT",
    "all_finite",
    "check_sampler",
    "SamplingSchedule",
    "sampling_schedule",
    "IntegratedChain",
    "integrate",
    "chain_log_prob",
    "network_velocity",
]


def all_finite(tensor: Tensor, what: str = "a checked tensor") -> bool:
    """Whether every entry of ``tensor`` is finite, at the cost of one sum.

    A finite sum proves every entry finite; only a non-finite sum (a NaN or inf entry, or
    finite entries whose sum overflows) needs the elementwise check. On the CPU this is
    several times cheaper than ``torch.isfinite(tensor).all()``, which allocates a mask.

    Under ``torch.compile`` the check stays in the graph instead of breaking it (reading a
    tensor's value in Python is a graph break): ``torch._assert_async`` raises a
    ``RuntimeError`` naming ``what`` when an entry is not finite, and the function returns
    ``True``. The callers' detailed ``ValueError`` messages are those of eager mode.

    Examples:
        >>> all_finite(torch.tensor([1.0, 2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
        >>> all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the entries do not
        True
    """
    tensor = tensor.detach()
    if torch.compiler.is_compiling():
        message = f"{what} is not finite (run without torch.compile for the detailed check)"
        torch._assert_async(torch.isfinite(tensor).all(), message)
        return True
    return math.isfinite(tensor.sum().item()) or bool(torch.isfinite(tensor).all())


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


class SamplingSchedule(NamedTuple):
    """The per-step constants of a ``K``-step sampler.

    Attributes:
        sigmas: ``[K + 1]`` the grid ``sigma_0 = 1 > ... > sigma_K = 0``.
        x_coefficient: ``[K]`` weight of ``x_k`` in the stochastic step's mean.
        velocity_coefficient: ``[K]`` weight of ``v_k`` in the stochastic step's mean.
        std: ``[K]`` the stochastic step's standard deviation.
        step_size: ``[K]`` the Euler step ``Delta_k = sigma_{k+1} - sigma_k`` (negative).
    """

    sigmas: Tensor
    x_coefficient: Tensor
    velocity_coefficient: Tensor
    std: Tensor
    step_size: Tensor

    @property
    def num_denoising_steps(self) -> int:
        """``K``."""
        return self.step_size.shape[0]


def sampling_schedule(
    num_denoising_steps: int,
    noise_level: float,
    shift: float = 1.0,
    noise_schedule: NoiseSchedule = "sqrt",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> SamplingSchedule:
    """The grid and the affine coefficients of every step (see :class:`SamplingSchedule`).

    Raises a ``ValueError`` when the grid is not strictly decreasing in ``dtype``
    (:func:`~torchrl_flowpolicy.flow.sigma_grid`).

    Examples:
        >>> schedule = sampling_schedule(4, noise_level=0.0)
        >>> schedule.sigmas, schedule.step_size
        (tensor([1.0000, 0.7500, 0.5000, 0.2500, 0.0000]), tensor([-0.2500, -0.2500, -0.2500, -0.2500]))
    """
    sigmas = sigma_grid(num_denoising_steps, shift, dtype=dtype, device=device)
    return SamplingSchedule(
        sigmas,
        *step_coefficients(sigmas, noise_level, noise_schedule),
        sigmas[1:] - sigmas[:-1],
    )


#: ``velocity(x [N, H, D], sigma [N]) -> v [N, H, D]`` for :func:`integrate`.
Velocity = Callable[[Tensor, Tensor], Tensor]
#: ``noise_std(x [N, H, D], sigma [N]) -> std [N, H, D]`` (> 0) for :func:`integrate`: the
#: learned per-entry std of a stochastic step (:mod:`~torchrl_flowpolicy.flow.noise`).
NoiseStd = Callable[[Tensor, Tensor], Tensor]


class IntegratedChain(NamedTuple):
    """What :func:`integrate` returns, always this one shape.

    Attributes:
        chain: ``[N, K + 1, H, D]`` the chain ``x_0 .. x_K``.
        means: ``[N, K, H, D]`` the Gaussian mean of every step (the ODE update at the
            deterministic ones); ``None`` without an ``sde_mask`` (the plain ODE).
        step_std: ``[N, K, H, D]`` the learned std of every step, 0 at the deterministic
            ones; ``None`` without a ``noise_std`` (the schedule's ``std_k`` then applies).
    """

    chain: Tensor
    means: Tensor | None
    step_std: Tensor | None


def integrate(
    velocity: Velocity,
    initial_noise: Tensor,
    schedule: SamplingSchedule,
    sde_mask: Tensor | None = None,
    step_noise: Tensor | None = None,
    *,
    sigma_dtype: torch.dtype | None = None,
    noise_std: NoiseStd | None = None,
) -> IntegratedChain:
    """Run the mixed ODE/SDE sampler from ``x_0 = initial_noise``.

    A stochastic step is ``x_{k+1} = x_coefficient_k x_k + velocity_coefficient_k v_k +
    std_k xi_k``, with ``std_k`` from the schedule or, with ``noise_std``, from that callback
    at the step's ``x_k`` (the learned-noise sampler: pass the ODE schedule,
    ``sampling_schedule(K, noise_level=0.0)``, for the Euler mean of Flow-Noise and ReinFlow).

    Args:
        velocity: ``velocity(x, sigma) -> v`` with ``x [N, H, D]`` (the dtype of the chain)
            and ``sigma [N]`` (``sigma_dtype``).
        initial_noise: ``x_0``, ``[N, H, D]``; its dtype is the chain's (float32 or wider).
        schedule: the sampler's constants (:func:`sampling_schedule`).
        sde_mask: ``[N, K]`` booleans, the stochastic steps; ``None``: the plain Euler ODE.
        step_noise: ``[N, K, H, D]`` standard normal noise ``xi_k`` (read where ``sde_mask``).
        sigma_dtype: the dtype of the ``sigma`` handed to ``velocity`` (default: the chain's).
        noise_std: ``noise_std(x, sigma) -> std``, the per-entry std of the stochastic steps
            (``[N, H, D]`` or broadcastable, > 0), called once per step that has a
            stochastic entry, instead of ``schedule.std``, with ``sigma [N]`` in the chain's
            dtype (as :func:`~torchrl_flowpolicy.flow.stochastic_steps` calls it); needs
            ``sde_mask``.

    Returns:
        An :class:`IntegratedChain` ``(chain, means, step_std)``; ``means`` is ``None``
        without ``sde_mask``, ``step_std`` without ``noise_std``.

    Raises:
        ValueError: the chain is not finite (the message names the first bad step), or
            ``noise_std`` gave a std that is not finite and > 0 at a stochastic entry.

    Examples:
        >>> schedule = sampling_schedule(4, noise_level=0.0)
        >>> ode = integrate(lambda x, sigma: torch.ones_like(x), torch.zeros(1, 2, 3), schedule)
        >>> ode.chain[0, -1, 0]  # x_K = x_0 + sum_k Delta_k * 1
        tensor([-1., -1., -1.])

        A learned std, here 0.5 everywhere, on the Euler mean:

        >>> mask = torch.tensor([[False, True, True, True]])
        >>> chain, means, step_std = integrate(
        ...     lambda x, sigma: torch.zeros_like(x), torch.zeros(1, 2, 3), schedule, mask,
        ...     torch.ones(1, 4, 2, 3), noise_std=lambda x, sigma: torch.full_like(x, 0.5))
        >>> chain[0, -1, 0], step_std[0, :, 0, 0]  # x_K = 3 steps * 0.5 * xi (xi = 1)
        (tensor([1.5000, 1.5000, 1.5000]), tensor([0.0000, 0.5000, 0.5000, 0.5000]))
    """
    if noise_std is not None and sde_mask is None:
        raise ValueError("integrate: noise_std needs an sde_mask (the stochastic steps).")
    num_denoising_steps = schedule.num_denoising_steps
    num_decisions = initial_noise.shape[0]
    sigma_dtype = initial_noise.dtype if sigma_dtype is None else sigma_dtype
    sigma_steps = (
        schedule.sigmas[:-1]
        .to(sigma_dtype)[:, None]
        .expand(num_denoising_steps, num_decisions)
        .unbind(0)
    )
    # Per-step (and, with a mask, per-decision) coefficients, selected once:
    # an ODE step is (1, Delta, 0).
    if sde_mask is None:
        x_coefficient = torch.ones_like(schedule.step_size)[None]
        velocity_coefficient = schedule.step_size[None]
        noise_steps = None
    else:
        x_coefficient = torch.where(sde_mask, schedule.x_coefficient, 1.0)
        velocity_coefficient = torch.where(
            sde_mask, schedule.velocity_coefficient, schedule.step_size
        )
        if noise_std is None:
            std = torch.where(sde_mask, schedule.std, 0.0)
            # The noise terms std_k * xi_k of all steps in one multiplication.
            noise_steps = (std[..., None, None] * step_noise).unbind(1)
        else:  # the std depends on x_k: computed in the loop
            noise_steps = None
            step_stochastic = sde_mask.any(0).tolist()
            # In the chain's dtype, as stochastic_steps hands them over when rescoring.
            noise_sigma_steps = schedule.sigmas[:-1, None].expand(
                num_denoising_steps, num_decisions
            )
            stochastic_rows = sde_mask[..., None, None].unbind(1)
            xi_steps = step_noise.unbind(1)
    x_steps = x_coefficient[..., None, None].unbind(1)
    velocity_steps = velocity_coefficient[..., None, None].unbind(1)
    # Preallocated, step-major: chain[k] and means[k] are contiguous blocks that each step
    # writes in place (``out=``); the returned views are [N, K + 1, H, D] and [N, K, H, D].
    chain = initial_noise.new_empty((num_denoising_steps + 1, *initial_noise.shape))
    chain[0] = initial_noise
    means = None if sde_mask is None else torch.empty_like(chain[1:])
    step_std = None if noise_std is None else torch.zeros_like(chain[1:])
    for step in range(num_denoising_steps):
        x = chain[step]
        v = velocity(x, sigma_steps[step])
        mean = chain[step + 1] if means is None else means[step]
        torch.add(x_steps[step] * x, velocity_steps[step] * v, out=mean)
        if noise_steps is not None:
            torch.add(mean, noise_steps[step], out=chain[step + 1])
        elif step_std is not None and step_stochastic[step]:
            std = noise_std(x, noise_sigma_steps[step])
            step_std[step] = torch.where(stochastic_rows[step], std, 0.0)
            torch.addcmul(mean, step_std[step], xi_steps[step], out=chain[step + 1])
        elif step_std is not None:
            chain[step + 1] = mean
    chain = chain.transpose(0, 1)
    if step_std is not None:
        step_std = step_std.transpose(0, 1)
        _check_step_std(step_std, sde_mask, schedule)
    if not all_finite(chain, "the sampled chain"):
        bad = int((~torch.isfinite(chain)).flatten(2).any(-1).any(0).nonzero()[0]) - 1
        if bad < 0:
            raise ValueError(
                "the initial noise x_0 (initial_noise) is not finite: the chain starts from "
                "NaN or inf. Check where the noise comes from (a DSRL noise actor, a decode "
                "call)."
            )
        raise ValueError(
            f"the velocity produced non-finite values at denoising step {bad} "
            f"(sigma={float(schedule.sigmas[bad]):.4f}): x_{bad + 1} is not finite. Check the "
            f"network's inputs (observation scaling) and its dtype."
        )
    return IntegratedChain(chain, None if means is None else means.transpose(0, 1), step_std)


def _check_step_std(step_std: Tensor, sde_mask: Tensor, schedule: SamplingSchedule) -> None:
    """Raise a ``ValueError`` naming the first step whose learned std is not finite and > 0."""
    entries = step_std[sde_mask]  # [M, H, D], the stochastic entries
    if entries.numel() == 0 or (all_finite(entries) and bool((entries > 0).all())):
        return
    bad_entries = ~(torch.isfinite(entries) & (entries > 0)).flatten(1).all(-1)
    bad = int(sde_mask.nonzero()[bad_entries][:, 1].min())
    raise ValueError(
        f"the noise std (noise_std, a noise head) is not finite and > 0 at denoising step "
        f"{bad} (sigma={float(schedule.sigmas[bad]):.4f}): the step's log-probability would be "
        f"NaN or inf. A noise head must return a positive std, e.g. through "
        f"flow.bounded_std; check its inputs and dtype."
    )


def chain_log_prob(
    chain: Tensor,
    means: Tensor,
    sde_mask: Tensor,
    std: Tensor,
    rows: int | None = None,
    action_mask: Tensor | None = None,
) -> Tensor:
    """Per-step log-probs ``[N, K]`` of a sampled chain, 0 where the step was deterministic.

    ``log N(x_{k+1}; mean_k, diag(std_k^2))`` summed over the leading ``rows`` chunk rows (the
    executed ones; default all) and the action dimensions that ``action_mask`` keeps.

    Args:
        chain: ``[N, K + 1, H, D]``; means: ``[N, K, H, D]`` (from :func:`integrate`);
            sde_mask: ``[N, K]``; std: ``[K]`` the stochastic steps' standard deviations (the
            fixed schedule), or ``[N, K, H, D]`` one per entry (the ``step_std`` of a
            learned noise, from :func:`integrate`); action_mask: ``[D]`` booleans, ``True``
            for the real action dimensions (``None``: all), as in
            :func:`~torchrl_flowpolicy.flow.gaussian_log_prob`.
    """
    rows = chain.shape[-2] if rows is None else rows
    if std.ndim > 1:  # one std per entry
        std = std[:, :, :rows]
        safe_std = torch.where(sde_mask[..., None, None], std, 1.0)
    else:
        safe_std = torch.where(sde_mask, std, 1.0)
    step_log_prob = gaussian_log_prob(
        chain[:, 1:, :rows], means[:, :, :rows], safe_std, mask=action_mask
    )
    return torch.where(sde_mask, step_log_prob, 0.0)


def network_velocity(
    network: Callable[..., Tensor],
    context: Tensor | tuple[Tensor, ...],
    network_dtype: torch.dtype,
    dtype: torch.dtype,
    name: str = "velocity_network",
) -> Callable[..., Tensor]:
    """The callback of :func:`integrate` and of the rescoring for ``network(x, sigma, context)``.

    Returns ``velocity(x, sigma[, decision_index])``: ``x`` and ``sigma`` are cast to
    ``network_dtype``, the velocity back to ``dtype`` (the chain's, float32 or wider) after a
    shape check; ``decision_index`` selects each entry's context (rescoring). The same
    wrapper serves a noise head (``noise_head(x, sigma, context) -> std``, the ``noise_std``
    callback); ``name`` is what the error messages call the network.
    """

    cast = network_dtype != dtype  # checked once: the sampler calls this K times

    def velocity(x: Tensor, sigma: Tensor, decision_index: Tensor | None = None) -> Tensor:
        entries = context
        if decision_index is not None and isinstance(context, tuple):
            entries = tuple(c[decision_index] for c in context)
        elif decision_index is not None:
            entries = context[decision_index]
        if sigma.dtype != network_dtype:
            sigma = sigma.to(network_dtype)
        v = network(x.to(network_dtype) if cast else x, sigma, entries)
        if not isinstance(v, Tensor):
            raise TypeError(
                f"{name} returned a {type(v).__name__}; expected a tensor of shape "
                f"{tuple(x.shape)} ([N, H, D], the shape of x)."
            )
        if v.shape != x.shape:
            raise ValueError(
                f"{name} returned shape {tuple(v.shape)}; expected "
                f"{tuple(x.shape)} ([N, H, D], the shape of x)."
            )
        return v.to(dtype) if cast else v

    return velocity
