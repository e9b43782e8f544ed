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
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from torchrl_flowpolicy.flow.gaussian import gaussian_log_prob
from torchrl_flowpolicy.flow.sde import NoiseSchedule, sigma_grid, step_coefficients

__all__ = [
    "all_finite",
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
    if torch.compiler.is_compiling():
        message = f"{what} is not finite (run without torch.compile for the detailed check)"
        torch._assert_async(torch.isfinite(tensor.detach()).all(), message)
        return True
    return math.isfinite(tensor.sum().item()) or bool(torch.isfinite(tensor).all())


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
    sigmas = schedule.sigmas[:-1, None]
    sigmas = sigmas if sigmas.dtype == sigma_dtype else sigmas.to(sigma_dtype)
    sigma_steps = sigmas.expand(num_denoising_steps, num_decisions).unbind(0)
    # Kind 0: an Euler step (no decision stochastic: (1, Delta_k, 0) give the same numbers); 1:
    # every decision stochastic; 2: per-decision coefficients (some; a learned std; or any mask
    # off the CPU or under torch.compile, which is not read: that would synchronise, or break
    # the graph).
    if sde_mask is None:
        kinds = [0] * num_denoising_steps
    elif noise_std is None and (sde_mask.device.type != "cpu" or torch.compiler.is_compiling()):
        kinds = [2] * num_denoising_steps
    else:  # how many decisions each step makes stochastic (one decision: its row)
        counts = sde_mask.sum(0).tolist() if num_decisions != 1 else sde_mask.tolist()[0]
        every = num_decisions if noise_std is None else -1
        kinds = [0 if count == 0 else 1 if count == every else 2 for count in counts]
    # The schedule's constants per step: 0-dim, or [1, 1] where the schedule is wider than the
    # chain (its products then promote, as the per-decision coefficients' do).
    dtype = initial_noise.dtype
    wider = torch.promote_types(schedule.step_size.dtype, dtype) != dtype
    step_sizes = (schedule.step_size[:, None, None] if wider else schedule.step_size).unbind(0)
    if 2 in kinds:  # per-decision coefficients, selected once
        x_coefficient = torch.where(sde_mask, schedule.x_coefficient, 1.0)
        velocity_coefficient = torch.where(
            sde_mask, schedule.velocity_coefficient, schedule.step_size
        )
        x_steps = x_coefficient[..., None, None].unbind(1)
        velocity_steps = velocity_coefficient[..., None, None].unbind(1)
        if noise_std is None:
            std = torch.where(sde_mask, schedule.std, 0.0)
            # The noise terms std_k * xi_k of all steps in one multiplication.
            noise_steps = (std[..., None, None] * step_noise).unbind(1)
        else:  # the std depends on x_k: computed in the loop
            # In the chain's dtype, as stochastic_steps hands them over when rescoring.
            noise_sigma_steps = schedule.sigmas[:-1, None].expand(-1, num_decisions)
            stochastic_rows = sde_mask[..., None, None].unbind(1)
            xi_steps = step_noise.unbind(1)
    # Each x_{k+1} and mean_k in the chain's dtype (as if written into it), stacked at the end
    # into [N, K + 1, H, D] and [N, K, H, D].
    x, chain, means = initial_noise, [initial_noise], []
    step_std = None if noise_std is None else []
    for step, kind in enumerate(kinds):
        v = velocity(x, sigma_steps[step])
        if kind == 0:
            mean = _cast(x + step_sizes[step] * v, dtype)
            if step_std is not None:
                step_std.append(torch.zeros_like(mean))
            x = mean
        elif kind == 1:
            index = (step, None, None) if wider else step
            x_coefficient, std = schedule.x_coefficient[index], schedule.std[index]
            mean = _cast(x_coefficient * x + schedule.velocity_coefficient[index] * v, dtype)
            x = _cast(mean + std * step_noise.select(1, step), dtype)
        elif noise_std is None:
            mean = _cast(x_steps[step] * x + velocity_steps[step] * v, dtype)
            x = _cast(mean + noise_steps[step], dtype)
        else:  # a learned std, at x_k
            mean = _cast(x_steps[step] * x + velocity_steps[step] * v, dtype)
            std = noise_std(x, noise_sigma_steps[step])
            step_std.append(_cast(torch.where(stochastic_rows[step], std, 0.0), dtype))
            x = _cast(torch.addcmul(mean, step_std[-1], xi_steps[step]), dtype)
        chain.append(x)
        means.append(mean)
    chain = torch.stack(chain, 1)
    means = None if sde_mask is None else torch.stack(means, 1)
    if step_std is not None:
        step_std = torch.stack(step_std, 1)
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
    return IntegratedChain(chain, means, step_std)


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` in ``dtype``, as ``out=`` a ``dtype`` tensor stores it (a no-op when it is)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


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
    sample, per_entry = chain[:, 1:], std.ndim > 1  # per entry: a learned std
    if rows is not None and rows != chain.shape[-2]:  # the leading rows
        sample, means = sample[:, :, :rows], means[:, :, :rows]
        std = std[:, :, :rows] if per_entry else std
    safe_std = torch.where(sde_mask[..., None, None] if per_entry else sde_mask, std, 1.0)
    step_log_prob = gaussian_log_prob(sample, means, safe_std, mask=action_mask)
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
