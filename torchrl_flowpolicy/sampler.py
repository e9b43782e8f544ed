"""``FlowSampler``: the Flow-SDE sampler of a velocity network, on tensors.

:class:`FlowSampler` (an ``nn.Module``) owns the velocity network, the optional encoder and
noise head, the chunk shape, the settings (:class:`SamplerOptions`, checked here), the cached
schedules, the dtype policy and an optional mask of padded action dimensions; its methods map
tensors to tensors. :class:`~torchrl_flowpolicy.FlowSDEPolicy` is its TensorDict shell.

:class:`SamplerOptions` is the one route for the sampler settings: a command line's
``--sampler.*`` group builds it, the sampler takes it whole, every checkpoint saves it
(:meth:`SamplerOptions.to_dict`) and every loader reads it back (:meth:`SamplerOptions.from_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import SamplingSchedule, StochasticSteps
from torchrl_flowpolicy.networks import check_declared_shape
from torchrl_flowpolicy.sampler_options import SamplerOptions, refuse_setting_attribute

__all__ = [
    "SamplerOptions",
    "SampledChain",
    "FlowSampler",
    "KLEstimator",
    "check_options",
    "parameter_dtype",
]

#: A per-decision context: the encoder's output, or the observation(s).
Context = Tensor | tuple[Tensor, ...]
#: ``"analytic"``: the closed-form KL of two Gaussian steps; ``"sample"``: ``log p - log q``
#: at the stored sample.
KLEstimator = Literal["analytic", "sample"]
#: The settings that only scale an initial noise: they enter no grid.
_NOISE_SCALES = ("rollout_noise_scale", "eval_noise_scale")


def parameter_dtype(module: object) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (float32 when it has none)."""
    for parameter in getattr(module, "parameters", list)():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def check_options(options: SamplerOptions, name: str = "options") -> None:
    """The sampler's check of ``options`` (:func:`flow.check_sampler`, float32 grids), for a
    command line that refuses bad settings before any work: random streams left as they were
    (the check may draw from torch's generator), a ``ValueError`` starting with ``name``."""
    with torch.random.fork_rng(devices=[]):
        try:
            flow.check_sampler(**options.to_dict())
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None


def _context_device(context: object) -> torch.device | None:
    """The device of the context's first tensor (``None`` when it holds none)."""
    for entry in context if isinstance(context, tuple) else (context,):
        if isinstance(entry, Tensor):
            return entry.device
    return None


class SampledChain(NamedTuple):
    """One rollout chain per decision, from :meth:`FlowSampler.sample` (``N`` decisions).

    Attributes:
        chain: ``[N, K + 1, H, D]`` the chain ``x_0 .. x_K``.
        sde_mask: ``[N, K]`` booleans, the stochastic steps.
        step_log_prob: ``[N, K]`` each stochastic step's log-probability, 0 at the others.
        step_std: ``[N, K, H, D]`` the noise head's std of every step (0 where ODE); ``None``
            without a noise head.
        action: ``[N, H', D]`` the executed rows of ``x_K``.
    """

    chain: Tensor
    sde_mask: Tensor
    step_log_prob: Tensor
    step_std: Tensor | None
    action: Tensor

    @property
    def log_prob(self) -> Tensor:
        """``[N]``, the chain's log-probability: the sum over its steps."""
        return self.step_log_prob.sum(-1)


class FlowSampler(nn.Module):
    """A velocity network with its Flow-SDE sampler, on tensors (``N`` decisions, any batch).

    A rollout (:meth:`sample`) integrates ``K = num_denoising_steps`` steps from
    ``x_0 = rollout_noise_scale * N(0, I)``; the steps that ``sde_mode`` picks are stochastic
    Flow-SDE steps (pi-RL's mixed ODE/SDE sampler, Chen et al., 2025, with Flow-GRPO's noise
    schedule), and their Gaussian log-probabilities cover the ``executed_chunk_length``
    leading rows. An evaluation (:meth:`ode_sample`) runs the plain Euler ODE with
    ``eval_num_denoising_steps`` from ``x_0 = eval_noise_scale * N(0, I)``. With a
    ``noise_head`` a stochastic step is the Euler step plus noise whose per-entry std the
    head predicts (pi-RL's Flow-Noise, ReinFlow); ``noise_level`` and ``noise_schedule`` then
    play no part. See ``docs/conventions.md`` and ``docs/learned_noise.md``.

    Args:
        velocity_network: ``velocity_network(x [N, H, D], sigma [N], context) -> v [N, H, D]``.

    Keyword Args:
        chunk_shape: ``(H, D)``, the shape of one decision's ``x_k``.
        encoder: optional ``encoder(*observations) -> context``, run once per decision.
        noise_head: optional ``noise_head(x, sigma, context) -> std [N, H, D] > 0``
            (:class:`~torchrl_flowpolicy.networks.NoiseHead`); may be set later.
        options: the sampler settings (default ``SamplerOptions()``); replace them with
            ``sampler.options = sampler.options.replace(noise_level=0.3)``.
        executed_chunk_length: ``H'`` in ``1..H``, the rows executed and scored (default ``H``).
        action_mask: ``[D]`` booleans, ``True`` for the real action dimensions: padded ones
            (a model that pads its actions) enter no Gaussian term and no flow-matching error.
            ``None`` (default): all dimensions are real.
        network_dtype: the dtype the velocity network computes in (``x`` and ``sigma`` are cast
            to it, ``v`` back to the chain's dtype); default: its first floating parameter's.
            The chain, log-probs and Gaussian terms stay float32 or wider
            (:func:`flow.probability_dtype <torchrl_flowpolicy.flow.probability_dtype>`).

    Setting ``options`` or ``executed_chunk_length`` checks the new value (a ``ValueError``
    naming the setting; a refused value changes nothing; a change of the noise scales alone
    checks only them) and clears the cached schedules. A setting set as an attribute (also by a
    former name, ``num_steps``) raises an ``AttributeError`` naming ``options``: not forwarded,
    so that settings change one way, checked as a whole.

    Examples:
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> sampler = FlowSampler(MLPVelocityNetwork(5, (4, 2)), chunk_shape=(4, 2))
        >>> context = sampler.context(torch.randn(3, 5))
        >>> rollout = sampler.sample(context, 3)
        >>> rollout.chain.shape, rollout.log_prob.shape
        (torch.Size([3, 9, 4, 2]), torch.Size([3]))
        >>> steps = sampler.rescore(context, rollout.chain, rollout.sde_mask)
        >>> log_prob = rollout.step_log_prob[rollout.sde_mask]
        >>> torch.testing.assert_close(sampler.log_prob(steps), log_prob)
        >>> sampler.ode(context, torch.zeros(3, 4, 2)).shape
        torch.Size([3, 4, 2])
    """

    def __init__(
        self,
        velocity_network: nn.Module | Callable[[Tensor, Tensor, Context], Tensor],
        *,
        chunk_shape: Sequence[int],
        encoder: nn.Module | Callable[..., Context] | None = None,
        noise_head: nn.Module | Callable[[Tensor, Tensor, Context], Tensor] | None = None,
        options: SamplerOptions | None = None,
        executed_chunk_length: int | None = None,
        action_mask: Tensor | None = None,
        network_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if len(chunk_shape) != 2 or not all(int(size) >= 1 for size in chunk_shape):
            raise ValueError(
                f"chunk_shape must be (chunk_length H, action_dim D) with positive sizes, got "
                f"{tuple(chunk_shape)}."
            )
        if network_dtype is not None and not getattr(network_dtype, "is_floating_point", False):
            raise ValueError(
                f"network_dtype must be a floating torch.dtype, got {network_dtype!r}."
            )
        self.chunk_shape = torch.Size(chunk_shape)
        self.executed_chunk_length = (
            self.chunk_shape[0] if executed_chunk_length is None else executed_chunk_length
        )
        self.declared_network_dtype = network_dtype
        self.velocity_network = velocity_network
        self.encoder = encoder
        self.noise_head = noise_head
        if action_mask is not None:
            flow.check_action_mask(action_mask, self.chunk_shape[1])
        self.register_buffer("action_mask", action_mask, persistent=False)
        self.options = SamplerOptions() if options is None else options

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_setting_attribute("sampler", name)
        if name in ("velocity_network", "noise_head") and value is not None:
            check_declared_shape(value, self.chunk_shape, name)
        super().__setattr__(name, value)

    @property
    def options(self) -> SamplerOptions:
        """The sampler settings (:class:`SamplerOptions`); set a new value to change them."""
        return self._options

    @options.setter
    def options(self, options: SamplerOptions) -> None:
        current = self.__dict__.get("_options")
        if not isinstance(options, SamplerOptions):
            raise TypeError(f"options must be a SamplerOptions, got {type(options).__name__}.")
        scales = {name: getattr(current, name, None) for name in _NOISE_SCALES}
        if current not in (None, options) and options.replace(**scales) == current:
            for name in _NOISE_SCALES:  # only a noise scale changed: it enters no grid
                flow.check_noise_scale(name, getattr(options, name))
        else:
            flow.check_sampler(**options.to_dict(), dtype=self.dtype)
        self._options = options
        self._schedules: dict[tuple, SamplingSchedule] = {}

    @property
    def executed_chunk_length(self) -> int:
        """``H'``, the leading chunk rows executed and scored."""
        return self._executed_chunk_length

    @executed_chunk_length.setter
    def executed_chunk_length(self, value: int) -> None:
        flow.check_integer("executed_chunk_length", value, 1)
        if value > self.chunk_shape[0]:
            raise ValueError(
                f"executed_chunk_length must be in 1..H={self.chunk_shape[0]}, got {value}."
            )
        self._executed_chunk_length = value
        self._schedules = {}

    @property
    def network_dtype(self) -> torch.dtype:
        """The velocity network's dtype: ``network_dtype`` if given, else its parameters'."""
        if self.declared_network_dtype is not None:
            return self.declared_network_dtype
        return parameter_dtype(self.velocity_network)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the chain and of every Gaussian term (float32 or wider)."""
        return flow.probability_dtype(self.network_dtype)

    def schedule(
        self, steps: int, dtype: torch.dtype, device: torch.device | None
    ) -> SamplingSchedule:
        """The schedule of ``steps`` denoising steps, cached per dtype and device.

        With a noise head, that of the Euler ODE (``noise_level = 0``): its stochastic steps
        keep the ODE mean and take their std from the head.
        """
        learned = self.noise_head is not None
        key = (steps, dtype, device, learned)
        if key not in self._schedules:
            level, options = 0.0 if learned else self.options.noise_level, self.options
            grid = (steps, level, options.shift, options.noise_schedule)
            self._schedules[key] = flow.sampling_schedule(*grid, dtype=dtype, device=device)
        return self._schedules[key]

    def context(self, *observations: Tensor, grad: bool = True) -> Context:
        """The per-decision context: ``encoder(*observations)``, or the observation(s).

        Without an encoder, the observation itself (a tuple when there are several). With
        ``grad=False`` the encoder runs under ``no_grad`` (the policy gradient stops there).
        """
        if self.encoder is None:
            return observations[0] if len(observations) == 1 else tuple(observations)
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            return self.encoder(*observations)

    def velocity(self, context: Context, network_dtype: torch.dtype | None = None) -> Callable:
        """The network as ``velocity(x, sigma[, decision_index])`` in the chain's dtype
        (:func:`flow.network_velocity <torchrl_flowpolicy.flow.network_velocity>`);
        ``network_dtype`` defaults to :attr:`network_dtype` (a walk over the parameters)."""
        network_dtype = network_dtype or self.network_dtype
        dtype = flow.probability_dtype(network_dtype)
        return flow.network_velocity(self.velocity_network, context, network_dtype, dtype)

    def noise_std(self, context: Context, dtype: torch.dtype | None = None) -> Callable:
        """The noise head as the ``noise_std`` callback, in ``dtype`` (default :attr:`dtype`)."""
        head, dtype = self.noise_head, dtype or self.dtype
        return flow.network_velocity(head, context, parameter_dtype(head), dtype, "noise_head")

    def _integrate(
        self,
        context: Context,
        initial_noise: Tensor,
        num_denoising_steps: int,
        sde_mask: Tensor | None = None,
        step_noise: Tensor | None = None,
        network_dtype: torch.dtype | None = None,
    ) -> tuple[flow.IntegratedChain, SamplingSchedule]:
        dtype, network_dtype = initial_noise.dtype, network_dtype or self.network_dtype
        schedule = self.schedule(num_denoising_steps, dtype, initial_noise.device)
        learned = self.noise_head is not None and sde_mask is not None
        noise_std = self.noise_std(context, dtype) if learned else None
        integrated = flow.integrate(
            self.velocity(context, network_dtype),
            initial_noise,
            schedule,
            sde_mask,
            step_noise,
            sigma_dtype=network_dtype,
            noise_std=noise_std,
        )
        return integrated, schedule

    @torch.no_grad()
    def sample(self, context: Context, num_decisions: int) -> SampledChain:
        """One rollout chain for each of the ``num_decisions`` decisions of ``context``."""
        options, network_dtype, device = self.options, self.network_dtype, _context_device(context)
        dtype, total_steps = flow.probability_dtype(network_dtype), options.num_denoising_steps
        noise = torch.randn(
            (num_decisions, total_steps + 1, *self.chunk_shape), dtype=dtype, device=device
        )
        mode, num_sde_steps = options.sde_mode, options.num_sde_steps
        sde_mask = flow.sample_sde_mask(
            (num_decisions,), total_steps, mode, num_sde_steps, device=device
        )
        if options.rollout_noise_scale != 1.0:
            noise[:, 0] = noise[:, 0] * options.rollout_noise_scale
        if options.noise_level == 0 and self.noise_head is None:
            # No noise, no Gaussian step: the chain is the Euler ODE and has no density.
            sde_mask = torch.zeros_like(sde_mask)
        integrated, schedule = self._integrate(
            context, noise[:, 0], total_steps, sde_mask, noise[:, 1:], network_dtype
        )
        chain, executed = integrated.chain, self.executed_chunk_length
        std = schedule.std if integrated.step_std is None else integrated.step_std
        step_log_prob = flow.chain_log_prob(
            chain, integrated.means, sde_mask, std, executed, self.action_mask
        )
        return SampledChain(
            chain, sde_mask, step_log_prob, integrated.step_std, chain[:, -1, :executed]
        )

    @torch.no_grad()
    def ode(self, context: Context, initial_noise: Tensor) -> Tensor:
        """The executed rows ``[N, H', D]`` of the ODE chunk (``eval_num_denoising_steps``)
        from ``x_0 = initial_noise [N, H, D]`` (cast to the chain's dtype)."""
        if tuple(initial_noise.shape[1:]) != tuple(self.chunk_shape):
            raise ValueError(
                f"initial_noise has shape {tuple(initial_noise.shape)}, expected (N, "
                f"{', '.join(map(str, self.chunk_shape))}) (decisions followed by chunk_shape)."
            )
        total_steps = self.options.eval_num_denoising_steps
        integrated, _ = self._integrate(context, initial_noise.to(self.dtype), total_steps)
        return integrated.chain[:, -1, : self.executed_chunk_length]

    @torch.no_grad()
    def ode_sample(self, context: Context, num_decisions: int) -> Tensor:
        """The evaluation chunk: :meth:`ode` from ``x_0 = eval_noise_scale * N(0, I)``."""
        noise = torch.randn(
            (num_decisions, *self.chunk_shape), dtype=self.dtype, device=_context_device(context)
        )  # drawn whatever the scale: the random stream does not depend on it
        if self.options.eval_noise_scale != 1.0:
            noise = noise * self.options.eval_noise_scale
        return self.ode(context, noise)

    def rescore(
        self,
        context: Context,
        chain: Tensor,
        sde_mask: Tensor,
        *,
        check_data: bool = True,
        chain_name: str = "chain",
        sde_mask_name: str = "sde_mask",
    ) -> StochasticSteps:
        """The Gaussian steps of stored chains ``[N, K + 1, H, D]`` (``sde_mask [N, K]``) under
        the current parameters: one batched call of each network over all ``M`` stochastic
        entries (:func:`flow.stochastic_steps <torchrl_flowpolicy.flow.stochastic_steps>`),
        gradient enabled. A ``ValueError`` names ``chain_name`` / ``sde_mask_name`` for data
        that cannot be scored: the wrong shape or ``K``, and the checks of
        :func:`flow.check_sde_mask <torchrl_flowpolicy.flow.check_sde_mask>` and
        :func:`flow.check_stochastic_steps <torchrl_flowpolicy.flow.check_stochastic_steps>`
        (the step-0 mask and the stored samples unless ``check_data=False``).
        """
        total_steps = self.options.num_denoising_steps
        expected = (total_steps + 1, *self.chunk_shape)
        mask_shape = (len(chain), total_steps)
        if tuple(chain.shape[1:]) != expected or tuple(sde_mask.shape) != mask_shape:
            raise ValueError(
                f"{chain_name} has shape {tuple(chain.shape)} and {sde_mask_name} "
                f"{tuple(sde_mask.shape)}; expected (N, {', '.join(map(str, expected))}) and "
                f"(N, {total_steps}): chains of num_denoising_steps={total_steps} steps, K + 1 "
                f"entries (the stored chain has K={chain.shape[1] - 1 if chain.ndim > 1 else '?'})."
            )
        if check_data:
            flow.check_sde_mask(sde_mask, sde_mask_name)
        network_dtype = self.network_dtype  # one walk over the parameters per call
        dtype, learned = flow.probability_dtype(network_dtype), self.noise_head is not None
        steps = flow.stochastic_steps(
            self.velocity(context, network_dtype),
            chain.to(dtype),
            sde_mask,
            self.schedule(total_steps, dtype, chain.device),
            self.executed_chunk_length,
            self.noise_std(context, dtype) if learned else None,
        )
        flow.check_stochastic_steps(steps, chain, check_samples=check_data, chain_name=chain_name)
        return steps

    def log_prob(self, steps: StochasticSteps) -> Tensor:
        """``[M]`` the Gaussian log-density of each step's stored sample (real dims only)."""
        return flow.gaussian_log_prob(steps.sample, steps.mean, steps.std, mask=self.action_mask)

    def entropy(self, steps: StochasticSteps) -> Tensor:
        """``[M]`` the entropy of each step's Gaussian (real dims only)."""
        return flow.gaussian_entropy(steps.std, steps.sample.shape, mask=self.action_mask)

    def kl(
        self,
        steps: StochasticSteps,
        reference: StochasticSteps,
        estimator: KLEstimator = "analytic",
    ) -> Tensor:
        """``[M]`` ``KL(steps || reference)`` per entry: in closed form (``"analytic"``) or
        ``log p - log q`` at the stored sample (``"sample"``), over the real dims."""
        mean, std = reference.mean.to(steps.mean.dtype), reference.std.to(steps.mean.dtype)
        if estimator == "analytic":
            return flow.gaussian_kl(steps.mean, steps.std, mean, std, mask=self.action_mask)
        log_prob = self.log_prob(steps)
        return log_prob - flow.gaussian_log_prob(steps.sample, mean, std, mask=self.action_mask)
