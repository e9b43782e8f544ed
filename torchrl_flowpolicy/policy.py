"""``FlowSDEPolicy``: a flow-matching action head as a scorable stochastic TorchRL policy."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor, nn
from torchrl.data import Binary, Composite, Unbounded
from torchrl.envs.utils import ExplorationType, exploration_type

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import NoiseSchedule, SDEMode

__all__ = [
    "FlowSDEPolicy",
    "StochasticSteps",
    "TimeReversedVelocity",
    "ACTION_KEY",
    "CHAIN_KEY",
    "SDE_MASK_KEY",
    "STEP_LOG_PROB_KEY",
    "LOG_PROB_KEY",
]

ACTION_KEY: NestedKey = "action"
CHAIN_KEY: NestedKey = ("flow", "chain")
SDE_MASK_KEY: NestedKey = ("flow", "sde_mask")
STEP_LOG_PROB_KEY: NestedKey = ("flow", "step_log_prob")
LOG_PROB_KEY: NestedKey = "action_log_prob"

Context = Tensor | tuple[Tensor, ...]


class StochasticSteps(NamedTuple):
    """The Gaussian transitions of the stochastic (decision, step) entries of a batch.

    ``M`` is the number of stochastic entries; entries are in row-major order of the
    flattened ``[N, K]`` mask.

    Attributes:
        decision_index: ``[M]`` index into the flattened batch of decisions.
        step_index: ``[M]`` denoising step ``k`` of each entry.
        mean: ``[M, H', D]`` the Gaussian mean ``mu_k`` under the current parameters.
        std: ``[M]`` the standard deviation ``std_k`` (parameter-free).
        sample: ``[M, H', D]`` the stored ``x_{k+1}``.

    ``H'`` is the number of executed rows (the chunk length unless restricted).
    """

    decision_index: Tensor
    step_index: Tensor
    mean: Tensor
    std: Tensor
    sample: Tensor


class TimeReversedVelocity(nn.Module):
    """Adapter for velocity networks written in the ``t = 0`` noise, ``t = 1`` action convention.

    Such networks (TorchRL-style flow-matching models, LeRobot's pi0 before its own
    reversal) interpolate ``x_t = t * action + (1 - t) * noise`` and predict
    ``v' = action - noise``. With ``t = 1 - sigma`` the library's velocity is
    ``v(x, sigma) = -v'(x, 1 - sigma)``.

    Args:
        network: a callable ``network(x, t, context) -> v'`` in the ``t = 0`` noise convention.

    Examples:
        >>> class DataMinusNoise(nn.Module):
        ...     def forward(self, x, t, context):
        ...         return context - x  # pushes x towards ``context``
        >>> adapted = TimeReversedVelocity(DataMinusNoise())
        >>> adapted(torch.zeros(1, 2, 3), torch.ones(1), torch.ones(1, 2, 3)).sum().item()
        -6.0
    """

    def __init__(self, network: Callable[[Tensor, Tensor, Context], Tensor]):
        super().__init__()
        self.network = network

    def forward(self, x: Tensor, sigma: Tensor, context: Context) -> Tensor:
        return -self.network(x, 1.0 - sigma, context)


def _index_context(context: Context, index: Tensor) -> Context:
    if isinstance(context, tuple):
        return tuple(c[index] for c in context)
    return context[index]


class FlowSDEPolicy(TensorDictModuleBase):
    """A velocity network as a TorchRL policy sampling chunks with the Flow-SDE sampler.

    Under RANDOM exploration (what collectors use) it integrates ``num_steps`` Euler steps
    from ``x_0 ~ N(0, I)``, making the steps chosen by ``sde_mode`` stochastic Flow-SDE
    steps, and writes (``[*B]`` is the tensordict's batch shape):

    | key | shape | meaning |
    | --- | --- | --- |
    | ``"action"`` | ``[*B, H', D]`` | executed rows of ``x_K`` (unclamped) |
    | ``("flow", "chain")`` | ``[*B, K+1, H, D]`` | ``x_0 .. x_K`` |
    | ``("flow", "sde_mask")`` | ``[*B, K]`` bool | which steps were stochastic |
    | ``("flow", "step_log_prob")`` | ``[*B, K]`` | per-step log-prob, 0 where ODE |
    | ``"action_log_prob"`` | ``[*B]`` | sum over the steps |

    ``H' = executed_chunk_length`` (default ``H``). Under DETERMINISTIC / MODE / MEAN
    exploration it runs the plain ODE with ``eval_num_steps`` from
    ``x_0 = eval_noise_scale * N(0, I)`` and writes ``"action"`` only: with the default scale
    1 it samples the model's own chunk distribution (the protocol of the results pages);
    ``eval_noise_scale = 0`` decodes the noise-free chunk ``x_0 = 0``, which a policy cloned
    from noisy demonstrations can execute much better than its samples (see
    ``docs/results.md``). Outside any exploration context it follows ``default_interaction_type``
    (DETERMINISTIC, as TorchRL's ``ProbabilisticActor``).

    The observation context (the encoder's output, or the observation itself when there is
    no encoder) is computed once per decision and reused for all denoising steps.

    Implements the mixed ODE/SDE sampler of pi-RL (Chen et al., 2025, "Flow-SDE") with the
    noise schedule of Flow-GRPO (Liu et al., 2025); the per-step log-probability is that of
    DPPO (Ren et al., 2024). See ``docs/conventions.md``.

    Args:
        velocity_network: ``velocity_network(x, sigma, context) -> v`` with ``x [N, H, D]``,
            ``sigma [N]`` and the context of those ``N`` decisions; returns ``[N, H, D]``.

    Keyword Args:
        action_shape: ``(H, D)``, the chunk shape.
        in_keys: observation keys read from the tensordict.
        encoder: optional ``encoder(*observations) -> context``, run once per decision.
        num_steps: ``K`` for rollouts and ``log_prob``.
        eval_num_steps: ``K`` for the deterministic ODE.
        eval_noise_scale: the standard deviation of the deterministic ODE's initial noise
            (>= 0; 1 samples the model's distribution, 0 decodes ``x_0 = 0``). Rollouts
            (RANDOM) and ``log_prob`` always start from ``N(0, I)``.
        noise_level: ``a`` (>= 0), the exploration knob. With ``a = 0`` no step is stochastic
            (the RANDOM chain is the Euler ODE, its log-probs are 0).
        sde_mode: ``"mixed"`` (one random stochastic step in ``1..K-1``), ``"last"``
            (the last ``num_sde_steps``) or ``"all"`` (``1..K-1``).
        num_sde_steps: the number of stochastic steps for ``"last"``.
        shift: time shift of the sigma grid (1.0: uniform).
        noise_schedule: ``"sqrt"`` (``g = a sqrt(sigma / (1 - sigma))``) or ``"constant"``.
        executed_chunk_length: the number of leading chunk rows the environment executes
            (pi-RL predicts 10 and executes 5); the log-probability covers those rows only.
            ``None``: all ``H`` rows.
        default_interaction_type: the mode used outside any exploration context.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl.envs.utils import ExplorationType, set_exploration_type
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> network = MLPVelocityNetwork(observation_dim=5, action_shape=(4, 2))
        >>> policy = FlowSDEPolicy(network, action_shape=(4, 2))
        >>> td = TensorDict({"observation": torch.randn(3, 5)}, batch_size=[3])
        >>> with set_exploration_type(ExplorationType.RANDOM):
        ...     td = policy(td)
        >>> td["flow", "chain"].shape, td["action_log_prob"].shape
        (torch.Size([3, 9, 4, 2]), torch.Size([3]))
        >>> torch.testing.assert_close(policy.log_prob(td), td["flow", "step_log_prob"])
    """

    def __init__(
        self,
        velocity_network: nn.Module | Callable[[Tensor, Tensor, Context], Tensor],
        *,
        action_shape: Sequence[int],
        in_keys: Sequence[NestedKey] = ("observation",),
        encoder: nn.Module | Callable[..., Context] | None = None,
        num_steps: int = 8,
        eval_num_steps: int = 20,
        eval_noise_scale: float = 1.0,
        noise_level: float = 0.5,
        sde_mode: SDEMode = "mixed",
        num_sde_steps: int = 4,
        shift: float = 1.0,
        noise_schedule: NoiseSchedule = "sqrt",
        executed_chunk_length: int | None = None,
        default_interaction_type: ExplorationType = ExplorationType.DETERMINISTIC,
    ):
        super().__init__()
        if len(action_shape) != 2:
            raise ValueError(
                f"action_shape must be (chunk_length H, action_dim D), got {tuple(action_shape)}."
            )
        self.action_shape = torch.Size(action_shape)
        chunk_length = self.action_shape[0]
        if executed_chunk_length is None:
            executed_chunk_length = chunk_length
        if not 1 <= executed_chunk_length <= chunk_length:
            raise ValueError(
                f"executed_chunk_length must be in 1..{chunk_length} (the chunk length), "
                f"got {executed_chunk_length}."
            )
        if noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {noise_level}.")
        if eval_num_steps < 1:
            raise ValueError(f"eval_num_steps must be >= 1, got {eval_num_steps}.")
        if not (math.isfinite(eval_noise_scale) and eval_noise_scale >= 0):
            raise ValueError(
                f"eval_noise_scale must be a finite number >= 0, got {eval_noise_scale}."
            )
        if noise_schedule not in ("sqrt", "constant"):
            raise ValueError(
                f"noise_schedule must be 'sqrt' or 'constant', got {noise_schedule!r}."
            )
        # Validates sde_mode against num_steps / num_sde_steps and shift (clear errors).
        flow.sample_sde_mask((1,), num_steps, sde_mode, num_sde_steps)
        flow.sigma_grid(num_steps, shift)
        self.velocity_network = velocity_network
        self.encoder = encoder
        self.in_keys = list(in_keys)
        self.out_keys = [ACTION_KEY, CHAIN_KEY, SDE_MASK_KEY, STEP_LOG_PROB_KEY, LOG_PROB_KEY]
        self.num_steps = num_steps
        self.eval_num_steps = eval_num_steps
        self.eval_noise_scale = float(eval_noise_scale)
        self.noise_level = float(noise_level)
        self.sde_mode = sde_mode
        self.num_sde_steps = num_sde_steps
        self.shift = float(shift)
        self.noise_schedule = noise_schedule
        self.executed_chunk_length = executed_chunk_length
        self.default_interaction_type = ExplorationType(default_interaction_type)
        self._schedule_cache: dict = {}

    # ------------------------------------------------------------------ helpers
    def __setattr__(self, name, value):
        if name in ("num_steps", "eval_num_steps", "noise_level", "shift", "noise_schedule"):
            self.__dict__["_schedule_cache"] = {}
        super().__setattr__(name, value)

    @property
    def network_dtype(self) -> torch.dtype:
        """The dtype of the velocity network's parameters (float32 when it has none)."""
        parameters = getattr(self.velocity_network, "parameters", None)
        if parameters is not None:
            for parameter in parameters():
                if parameter.is_floating_point():
                    return parameter.dtype
        return torch.float32

    @property
    def spec(self) -> Composite:
        """The spec of the entries written under RANDOM exploration, for one decision.

        TorchRL collectors read it to pre-allocate their buffers. Without it a collector
        probes the policy once at construction, outside any exploration context, where the
        policy runs the deterministic ODE and writes ``"action"`` only, so the collector
        would silently drop the chain, mask and log-probs from every collected batch.
        """
        dtype = flow.probability_dtype(self.network_dtype)
        parameter = next(iter(getattr(self.velocity_network, "parameters", list)()), None)
        device = None if parameter is None else parameter.device
        chunk_length, action_dim = self.action_shape
        num_steps = self.num_steps
        spec = Composite(device=device)
        spec[ACTION_KEY] = Unbounded(
            (self.executed_chunk_length, action_dim), dtype=dtype, device=device
        )
        spec[CHAIN_KEY] = Unbounded(
            (num_steps + 1, chunk_length, action_dim), dtype=dtype, device=device
        )
        spec[SDE_MASK_KEY] = Binary(num_steps, dtype=torch.bool, device=device)
        spec[STEP_LOG_PROB_KEY] = Unbounded((num_steps,), dtype=dtype, device=device)
        spec[LOG_PROB_KEY] = Unbounded((), dtype=dtype, device=device)
        return spec

    def _schedule(
        self, num_steps: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(sigmas [K+1], x_coefficient [K], velocity_coefficient [K], std [K])``, cached."""
        return self._sampling_schedule(num_steps, dtype, device)[:4]

    def _sampling_schedule(
        self, num_steps: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """:meth:`_schedule` followed by the Euler step sizes ``Delta_k [K]``, cached."""
        key = (num_steps, dtype, device)
        cached = self._schedule_cache.get(key)
        if cached is None:
            sigmas = flow.sigma_grid(num_steps, self.shift, dtype=dtype, device=device)
            cached = (
                sigmas,
                *flow.step_coefficients(sigmas, self.noise_level, self.noise_schedule),
                sigmas[1:] - sigmas[:-1],
            )
            self._schedule_cache[key] = cached
        return cached

    def _observations(self, tensordict: TensorDictBase) -> list[Tensor]:
        observations = []
        for key in self.in_keys:
            value = tensordict.get(key, None)
            if value is None:
                raise KeyError(
                    f"FlowSDEPolicy reads the observation key {key!r}, which is missing from "
                    f"the tensordict (keys: {list(tensordict.keys(True, True))}). Pass "
                    f"in_keys=[...] naming the observation entries."
                )
            observations.append(
                value.flatten(0, tensordict.batch_dims - 1)
                if tensordict.batch_dims
                else value.unsqueeze(0)
            )
        return observations

    def context(self, tensordict: TensorDictBase, *, grad: bool = True) -> Context:
        """The per-decision context for the flattened batch ``[N, ...]``.

        The encoder's output, or the observation itself (a tuple when there are several
        observation keys) without an encoder. With ``grad=False`` the encoder runs under
        ``no_grad`` (the learner's default: the policy gradient stops at the context).
        """
        observations = self._observations(tensordict)
        if self.encoder is None:
            return observations[0] if len(observations) == 1 else tuple(observations)
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            return self.encoder(*observations)

    def _velocity(self, x: Tensor, sigma: Tensor, context: Context, step: int | str) -> Tensor:
        velocity = self.velocity_network(x, sigma, context)
        if velocity.shape != x.shape:
            raise ValueError(
                f"velocity_network returned shape {tuple(velocity.shape)} at denoising step "
                f"{step}; expected {tuple(x.shape)} ([N, H, D], the shape of x)."
            )
        return velocity

    @staticmethod
    def _raise_non_finite(chain: Tensor, sigmas: Tensor) -> None:
        bad_steps = (~torch.isfinite(chain)).flatten(2).any(-1).any(0).nonzero()
        step = int(bad_steps[0]) - 1
        raise ValueError(
            f"velocity_network produced non-finite values at denoising step {step} "
            f"(sigma={float(sigmas[step]):.4f}): x_{step + 1} is not finite. Check the "
            f"network's inputs (observation scaling) and its dtype."
        )

    # ------------------------------------------------------------------ sampling
    def _integrate(
        self,
        context: Context,
        initial_noise: Tensor,
        num_steps: int,
        sde_mask: Tensor | None,
        step_noise: Tensor | None,
        *,
        network_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Run the mixed ODE/SDE chain. Returns ``(chain, means or None, sigmas)``.

        ``network_dtype`` saves the parameter lookup when the caller already has it.
        """
        if network_dtype is None:
            network_dtype = self.network_dtype
        dtype = flow.probability_dtype(network_dtype)
        cast = network_dtype != dtype
        sigmas, x_coefficient, velocity_coefficient, std, step_size = self._sampling_schedule(
            num_steps, dtype, initial_noise.device
        )
        num_decisions = initial_noise.shape[0]
        sigma_steps = (
            sigmas[:-1].to(network_dtype)[:, None].expand(num_steps, num_decisions).unbind(0)
        )
        # Preallocated, step-major: chain[k] and means[k] are contiguous blocks that each step
        # writes in place (``out=``); the returned views are [N, K + 1, H, D] and [N, K, H, D].
        chain = initial_noise.new_empty(
            (num_steps + 1, num_decisions, *self.action_shape), dtype=dtype
        )
        chain[0] = initial_noise
        means = None
        if sde_mask is None:
            for step in range(num_steps):
                x = chain[step]
                velocity = self._velocity(
                    x.to(network_dtype) if cast else x, sigma_steps[step], context, step
                )
                if cast:
                    velocity = velocity.to(dtype)
                torch.add(x, velocity * step_size[step], out=chain[step + 1])
        else:
            # Per-decision coefficients, selected once: an ODE step is (1, Delta, 0).
            x_coefficient = torch.where(sde_mask, x_coefficient, 1.0)
            velocity_coefficient = torch.where(sde_mask, velocity_coefficient, step_size)
            std = torch.where(sde_mask, std, 0.0)
            # The noise terms std_k * xi_k of all steps in one multiplication.
            noise_steps = (std[..., None, None] * step_noise).unbind(1)
            x_steps = x_coefficient[..., None, None].unbind(1)
            velocity_steps = velocity_coefficient[..., None, None].unbind(1)
            means = torch.empty_like(chain[1:])
            for step in range(num_steps):
                x = chain[step]
                velocity = self._velocity(
                    x.to(network_dtype) if cast else x, sigma_steps[step], context, step
                )
                if cast:
                    velocity = velocity.to(dtype)
                torch.add(x_steps[step] * x, velocity_steps[step] * velocity, out=means[step])
                torch.add(means[step], noise_steps[step], out=chain[step + 1])
            means = means.transpose(0, 1)
        chain = chain.transpose(0, 1)
        # A finite sum proves a finite chain; only a non-finite sum needs the exact check.
        if not torch.isfinite(chain.sum()) and not torch.isfinite(chain).all():
            self._raise_non_finite(chain, sigmas)
        return chain, means, sigmas

    def _new_noise(
        self, shape: Sequence[int], like: Tensor, network_dtype: torch.dtype | None = None
    ) -> Tensor:
        if network_dtype is None:
            network_dtype = self.network_dtype
        dtype = flow.probability_dtype(network_dtype)
        return torch.randn(tuple(shape), dtype=dtype, device=like.device)

    @torch.no_grad()
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Sample chunks (see the class docstring); never tracks gradients.

        Gradients of the log-probabilities come from :meth:`log_prob` /
        :meth:`stochastic_steps`, which recompute them from the stored chain.
        """
        mode = exploration_type() or self.default_interaction_type
        batch_shape = tensordict.batch_size
        context = self.context(tensordict)
        reference = context[0] if isinstance(context, tuple) else context
        num_decisions = max(math.prod(batch_shape), 1)
        executed = self.executed_chunk_length
        network_dtype = self.network_dtype
        if len(batch_shape) == 1:

            def unflatten(value: Tensor) -> Tensor:
                return value

        else:

            def unflatten(value: Tensor) -> Tensor:
                return value.reshape((*batch_shape, *value.shape[1:]))

        if mode != ExplorationType.RANDOM:
            noise = self._new_noise((num_decisions, *self.action_shape), reference, network_dtype)
            if self.eval_noise_scale != 1.0:
                noise = noise * self.eval_noise_scale
            chain, _, _ = self._integrate(
                context, noise, self.eval_num_steps, None, None, network_dtype=network_dtype
            )
            return tensordict.set(ACTION_KEY, unflatten(chain[:, -1, :executed]))

        num_steps = self.num_steps
        noise = self._new_noise(
            (num_decisions, num_steps + 1, *self.action_shape), reference, network_dtype
        )
        sde_mask = flow.sample_sde_mask(
            (num_decisions,), num_steps, self.sde_mode, self.num_sde_steps, device=reference.device
        )
        if self.noise_level == 0:
            # No noise, no Gaussian step: the chain is the Euler ODE and has no density.
            sde_mask = torch.zeros_like(sde_mask)
        chain, means, _ = self._integrate(
            context, noise[:, 0], num_steps, sde_mask, noise[:, 1:], network_dtype=network_dtype
        )
        std = self._sampling_schedule(num_steps, chain.dtype, chain.device)[3]
        safe_std = torch.where(sde_mask, std, 1.0)
        # The log-prob covers the executed rows only (all H rows by default).
        step_log_prob = flow.gaussian_log_prob(
            chain[:, 1:, :executed], means[:, :, :executed], safe_std
        )
        step_log_prob = torch.where(sde_mask, step_log_prob, 0.0)

        tensordict.set(ACTION_KEY, unflatten(chain[:, -1, :executed]))
        tensordict.set(CHAIN_KEY, unflatten(chain))
        tensordict.set(SDE_MASK_KEY, unflatten(sde_mask))
        tensordict.set(STEP_LOG_PROB_KEY, unflatten(step_log_prob))
        tensordict.set(LOG_PROB_KEY, unflatten(step_log_prob.sum(-1)))
        return tensordict

    @torch.no_grad()
    def decode(self, tensordict: TensorDictBase, initial_noise: Tensor) -> Tensor:
        """The deterministic ODE chunk (``eval_num_steps``) from a given initial noise.

        Args:
            tensordict: holds the observation(s) for a batch ``[*B]``.
            initial_noise: ``x_0``, ``[*B, H, D]``.

        Returns:
            The executed rows of ``x_K``, ``[*B, H', D]``. Runs under ``no_grad`` (DSRL).
        """
        batch_shape = tensordict.batch_size
        expected = (*batch_shape, *self.action_shape)
        if tuple(initial_noise.shape) != expected:
            raise ValueError(
                f"initial_noise has shape {tuple(initial_noise.shape)}, expected {expected} "
                f"(batch shape followed by action_shape (H, D))."
            )
        noise = initial_noise.reshape(-1, *self.action_shape).to(
            flow.probability_dtype(self.network_dtype)
        )
        chain, _, _ = self._integrate(
            self.context(tensordict), noise, self.eval_num_steps, None, None
        )
        action = chain[:, -1, : self.executed_chunk_length]
        return action.reshape((*batch_shape, *action.shape[1:]))

    # ------------------------------------------------------------------ learner
    def _stored(self, tensordict: TensorDictBase, key: NestedKey, trailing: tuple) -> Tensor:
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"log_prob needs {key!r}, written by FlowSDEPolicy under RANDOM exploration; "
                f"it is missing from the tensordict (keys: {list(tensordict.keys(True, True))})."
            )
        expected = (*tensordict.batch_size, *trailing)
        if tuple(value.shape) != expected:
            hint = ""
            if (
                len(trailing) == 3
                and value.ndim == len(expected)
                and value.shape[-3] != trailing[0]
            ):
                hint = (
                    f" The stored chain has K={value.shape[-3] - 1} steps but the policy has "
                    f"num_steps={self.num_steps}: score it with a policy of the same num_steps."
                )
            raise ValueError(
                f"{key!r} has shape {tuple(value.shape)}, expected {expected} (batch shape "
                f"{tuple(tensordict.batch_size)} followed by {trailing}).{hint}"
            )
        return value.reshape(-1, *trailing)

    def stochastic_steps(
        self,
        tensordict: TensorDictBase,
        *,
        context_grad: bool = False,
        chain_key: NestedKey = CHAIN_KEY,
        sde_mask_key: NestedKey = SDE_MASK_KEY,
    ) -> StochasticSteps:
        """Recompute the Gaussian transitions of the stored stochastic steps.

        One batched network call over all stochastic ``(decision, step)`` entries, with the
        current parameters and gradient enabled (through the mean only).

        Args:
            tensordict: holds the observation(s), ``("flow", "chain")`` and
                ``("flow", "sde_mask")`` with batch shape ``[*B]``.
            context_grad: let the gradient reach the encoder (default: ``no_grad``).
            chain_key: where the chain is stored.
            sde_mask_key: where the stochastic-step mask is stored.
        """
        num_steps = self.num_steps
        chain = self._stored(tensordict, chain_key, (num_steps + 1, *self.action_shape))
        sde_mask = self._stored(tensordict, sde_mask_key, (num_steps,))
        context = self.context(tensordict, grad=context_grad)
        network_dtype = self.network_dtype
        dtype = flow.probability_dtype(network_dtype)
        chain = chain.to(dtype)
        sigmas, x_coefficient, velocity_coefficient, std = self._schedule(
            num_steps, dtype, chain.device
        )
        decision_index, step_index = sde_mask.bool().nonzero(as_tuple=True)
        x = chain[decision_index, step_index]
        sample = chain[decision_index, step_index + 1]
        velocity = self._velocity(
            x.to(network_dtype),
            sigmas.to(network_dtype)[step_index],
            _index_context(context, decision_index),
            "log_prob",
        ).to(dtype)
        if not torch.isfinite(velocity).all():
            raise ValueError(
                "velocity_network produced non-finite values while recomputing log-probs "
                "from the stored chain (log_prob)."
            )
        mean = (
            x_coefficient[step_index, None, None] * x
            + velocity_coefficient[step_index, None, None] * velocity
        )
        executed = self.executed_chunk_length
        return StochasticSteps(
            decision_index, step_index, mean[:, :executed], std[step_index], sample[:, :executed]
        )

    def scatter_steps(
        self, tensordict: TensorDictBase, steps: StochasticSteps, values: Tensor
    ) -> Tensor:
        """Place per-entry ``values [M]`` into a zero ``[*B, K]`` tensor."""
        num_decisions = max(math.prod(tensordict.batch_size), 1)
        out = values.new_zeros(num_decisions, self.num_steps)
        out = out.index_put((steps.decision_index, steps.step_index), values)
        return out.reshape((*tensordict.batch_size, self.num_steps))

    def log_prob(self, tensordict: TensorDictBase, *, context_grad: bool = False) -> Tensor:
        """Per-step log-probs ``[*B, K]`` of a stored chain under the current parameters.

        Zero where a step was not stochastic. Recomputed with one batched network call over
        all stochastic entries (never a loop over ``K``), gradient enabled.
        """
        steps = self.stochastic_steps(tensordict, context_grad=context_grad)
        log_prob = flow.gaussian_log_prob(steps.sample, steps.mean, steps.std)
        return self.scatter_steps(tensordict, steps, log_prob)
