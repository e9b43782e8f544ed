"""``FlowSDEPolicy``: a flow-matching action head as a scorable stochastic TorchRL policy.

A thin TensorDict shell over :mod:`torchrl_flowpolicy.flow`: it maps keys to tensors,
computes the observation context once per decision, dispatches on the exploration type and
validates its parameters; the sampler, its schedule and the rescoring are ``flow``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor, nn
from torchrl.data import Binary, Composite, Unbounded
from torchrl.envs.utils import ExplorationType, exploration_type

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import NoiseSchedule, SamplingSchedule, SDEMode, StochasticSteps

__all__ = ["FlowSDEPolicy"]


def _parameter_dtype(module: object) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (float32 when it has none)."""
    for parameter in getattr(module, "parameters", list)():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


Context = Tensor | tuple[Tensor, ...]

#: Parameters whose change invalidates the cached sampling schedules.
_SCHEDULE_PARAMETERS = ("num_steps", "eval_num_steps", "noise_level", "shift", "noise_schedule")
#: Parameters validated together (:meth:`FlowSDEPolicy._check_sampler`), at construction and
#: whenever one of them is set.
_SAMPLER_PARAMETERS = (*_SCHEDULE_PARAMETERS, "sde_mode", "num_sde_steps")


class FlowSDEPolicy(TensorDictModuleBase):
    """A velocity network as a TorchRL policy sampling chunks with the Flow-SDE sampler.

    Under RANDOM exploration (collectors, and any call outside an exploration context, see
    ``default_interaction_type``) it integrates ``num_steps`` steps from
    ``x_0 = rollout_noise_scale * N(0, I)``, the steps chosen by ``sde_mode`` being
    stochastic Flow-SDE steps, and writes (``[*B]`` the batch shape; keys renamed with
    :meth:`set_keys`):

    | key (``set_keys`` name) | shape | meaning |
    | --- | --- | --- |
    | ``"action"`` (``action``) | ``[*B, H', D]`` | executed rows of ``x_K`` (unclamped) |
    | ``("flow", "chain")`` (``chain``) | ``[*B, K+1, H, D]`` | ``x_0 .. x_K`` |
    | ``("flow", "sde_mask")`` (``sde_mask``) | ``[*B, K]`` bool | which steps were stochastic |
    | ``("flow", "step_log_prob")`` (``step_log_prob``) | ``[*B, K]`` | per-step log-prob, 0 where ODE |
    | ``"action_log_prob"`` (``log_prob``) | ``[*B]`` | sum over the steps |
    | ``("flow", "step_std")`` (``step_std``) | ``[*B, K, H, D]`` | with a ``noise_head`` only: each step's std, 0 where ODE |

    ``H = chunk_length`` rows are predicted, ``H' = executed_chunk_length`` executed. A
    single-step policy (``action_shape=(D,)``, one action per environment step, for an
    unwrapped TorchRL environment) writes ``"action"`` ``[*B, D]`` and the chain
    ``[*B, K+1, D]``: the chain is always ``[*B, K+1, *action_shape]``; its velocity network
    sees chunks of one row, ``x [N, 1, D]`` (:attr:`chunk_shape`).

    Under DETERMINISTIC / MODE / MEAN exploration (evaluation) it runs the plain ODE with
    ``eval_num_steps`` from ``x_0 = eval_noise_scale * N(0, I)`` and writes the action only.
    With the default ``eval_noise_scale = 0`` that is the noise-free chunk (``x_0 = 0``): the
    same observation gives the same action at every call. ``eval_noise_scale = 1`` samples
    the model's distribution with the ODE instead (a fresh ``x_0`` at every call). The context
    (encoder output, or the observation) is computed once per decision.

    Implements the mixed ODE/SDE sampler of pi-RL (Chen et al., 2025, "Flow-SDE") with the
    noise schedule of Flow-GRPO (Liu et al., 2025); the per-step log-probability is that of
    DPPO (Ren et al., 2024). See ``docs/conventions.md``.

    With a ``noise_head`` (a learned exploration noise, pi-RL's Flow-Noise and ReinFlow,
    ``docs/learned_noise.md``) a stochastic step is the Euler ODE step plus Gaussian noise
    whose per-entry std the head predicts from ``(x_k, sigma_k, context)``:
    ``x_{k+1} = x_k + v_k Delta_k + std_k xi_k``. ``noise_level`` and ``noise_schedule``
    then play no part (the mean is the ODE's, the std the head's; a ``noise_level`` of 0
    does not turn the stochastic steps off), ``log_prob`` recomputes the mean and the std
    from the stored chain with one batched call of each network, and the gradient reaches
    the head through the std.

    Args:
        velocity_network: ``velocity_network(x, sigma, context) -> v`` with ``x [N, H, D]``,
            ``sigma [N]`` and the context of those ``N`` decisions; returns ``[N, H, D]``
            (``H = 1`` for a single-step policy).

    Keyword Args:
        action_shape: ``(H, D)``, the chunk shape; or ``(D,)``, a single-step policy (one
            action per environment step, ``H = H' = 1``).
        in_keys: observation keys read from the tensordict.
        encoder: optional ``encoder(*observations) -> context``, run once per decision.
        num_steps: ``K`` for rollouts and ``log_prob`` (an integer).
        eval_num_steps: ``K`` for the deterministic ODE (an integer >= 1).
        eval_noise_scale: the standard deviation of the deterministic ODE's initial noise
            (>= 0). 0 (default): the noise-free chunk ``x_0 = 0``, repeatable; 1: the ODE
            from ``x_0 ~ N(0, I)``, a sample of the model's distribution.
        rollout_noise_scale: the standard deviation of the rollouts' (RANDOM) initial noise
            ``x_0`` (>= 0; default 1, the model's distribution). With 0 every chain starts at
            ``x_0 = 0``: the exploration then comes from the stochastic steps alone, all of it
            in the log-probability, and the noise-free decoding (``eval_noise_scale=0``) is
            the policy that the rollouts perturb. ``x_0`` is stored in the chain, and its
            density does not depend on the parameters, so ``log_prob`` is the same either way.
        noise_level: ``a`` (finite, >= 0), the exploration knob. With ``a = 0`` no step is
            stochastic (the RANDOM chain is the Euler ODE, its log-probs are 0). A value that
            makes a stochastic step overshoot (about ``a > 2``) warns
            (:func:`flow.check_sampler <torchrl_flowpolicy.flow.check_sampler>`).
        sde_mode: ``"mixed"`` (one random stochastic step in ``1..K-1``), ``"last"``
            (the last ``num_sde_steps``) or ``"all"`` (``1..K-1``).
        num_sde_steps: the number of stochastic steps for ``"last"``.
        shift: time shift of the sigma grid (finite, > 0; 1.0: uniform). A shift so large
            that two noise levels are equal in the chain's dtype is refused.
        noise_schedule: ``"sqrt"`` (``g = a sqrt(sigma / (1 - sigma))``) or ``"constant"``.
        executed_chunk_length: ``H'``, the number of leading chunk rows the environment
            executes (pi-RL predicts 10 and executes 5); the log-probability covers those rows
            only. ``None``: all ``H`` rows.
        default_interaction_type: the mode used outside any exploration context. RANDOM
            (default), as the actor of TorchRL's PPO scripts: a collector that probes the
            policy outside a context (``compile_policy`` / ``cudagraph_policy`` hide
            :attr:`spec`) then sees the chain and the log-probs. Evaluate under
            ``set_exploration_type(ExplorationType.DETERMINISTIC)``.
        noise_head: optional ``noise_head(x, sigma, context) -> std`` with ``x [N, H, D]``,
            ``sigma [N]`` and the context of those decisions (the encoder's output, shared
            with the velocity network), returning ``std [N, H, D] > 0``: the learned
            exploration noise (:class:`~torchrl_flowpolicy.networks.NoiseHead`). ``None``
            (default): the fixed Flow-SDE schedule. It may also be set later,
            ``policy.noise_head = NoiseHead(...)`` (a fresh head at the start of RL).

    The sampler parameters (``num_steps``, ``eval_num_steps``, ``noise_level``, ``sde_mode``,
    ``num_sde_steps``, ``shift``, ``noise_schedule``) are checked together at construction and
    whenever one is set (``policy.noise_level = 0.3``): a bad value raises a ``ValueError``
    naming it and leaves the policy unchanged. A velocity network that declares an
    ``action_shape`` (the reference networks do) must match the policy's.

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

        A single-step policy steps an unwrapped environment:

        >>> step_policy = FlowSDEPolicy(MLPVelocityNetwork(5, (1, 2)), action_shape=(2,))
        >>> td = step_policy(TensorDict({"observation": torch.randn(3, 5)}, batch_size=[3]))
        >>> td["action"].shape, td["flow", "chain"].shape
        (torch.Size([3, 2]), torch.Size([3, 9, 2]))
    """

    @dataclass
    class _AcceptedKeys:
        """The entries the policy writes (the table above); renamed with ``set_keys``."""

        action: NestedKey = "action"
        chain: NestedKey = ("flow", "chain")
        sde_mask: NestedKey = ("flow", "sde_mask")
        step_log_prob: NestedKey = ("flow", "step_log_prob")
        log_prob: NestedKey = "action_log_prob"
        step_std: NestedKey = ("flow", "step_std")

    default_keys = _AcceptedKeys

    def __init__(
        self,
        velocity_network: nn.Module | Callable[[Tensor, Tensor, Context], Tensor],
        *,
        action_shape: Sequence[int],
        in_keys: Sequence[NestedKey] = ("observation",),
        encoder: nn.Module | Callable[..., Context] | None = None,
        num_steps: int = 8,
        eval_num_steps: int = 20,
        eval_noise_scale: float = 0.0,
        rollout_noise_scale: float = 1.0,
        noise_level: float = 0.5,
        sde_mode: SDEMode = "mixed",
        num_sde_steps: int = 4,
        shift: float = 1.0,
        noise_schedule: NoiseSchedule = "sqrt",
        executed_chunk_length: int | None = None,
        default_interaction_type: ExplorationType = ExplorationType.RANDOM,
        noise_head: nn.Module | Callable[[Tensor, Tensor, Context], Tensor] | None = None,
    ):
        super().__init__()
        if len(action_shape) not in (1, 2) or not all(int(size) >= 1 for size in action_shape):
            raise ValueError(
                f"action_shape must be (chunk_length H, action_dim D), or (action_dim D,) for a "
                f"single-step policy, with positive sizes; got {tuple(action_shape)}."
            )
        self.action_shape = torch.Size(action_shape)
        chunk_length = self.chunk_shape[0]
        if executed_chunk_length is None:
            executed_chunk_length = chunk_length
        if self.single_step and executed_chunk_length != 1:
            raise ValueError(
                f"a single-step policy (action_shape={tuple(action_shape)}) executes one action "
                f"per step: executed_chunk_length must be None or 1, got {executed_chunk_length}."
            )
        if not 1 <= executed_chunk_length <= chunk_length:
            raise ValueError(
                f"executed_chunk_length must be in 1..{chunk_length} (the chunk length), "
                f"got {executed_chunk_length}."
            )
        if not (math.isfinite(eval_noise_scale) and eval_noise_scale >= 0):
            raise ValueError(
                f"eval_noise_scale must be a finite number >= 0, got {eval_noise_scale}."
            )
        if not (math.isfinite(rollout_noise_scale) and rollout_noise_scale >= 0):
            raise ValueError(
                f"rollout_noise_scale must be a finite number >= 0, got {rollout_noise_scale}."
            )
        self._check_declared_shape(velocity_network, "velocity_network")
        self.velocity_network = velocity_network
        self.encoder = encoder
        self.in_keys = list(in_keys)
        self.tensor_keys = self._AcceptedKeys()
        self.noise_head = noise_head  # sets out_keys (__setattr__)
        sampler = {
            "num_steps": num_steps,
            "eval_num_steps": eval_num_steps,
            "noise_level": noise_level,
            "shift": shift,
            "noise_schedule": noise_schedule,
            "sde_mode": sde_mode,
            "num_sde_steps": num_sde_steps,
        }
        self._check_sampler(sampler)
        # Set past __setattr__'s check, which validates one changed parameter against the others.
        self.__dict__.update(sampler, noise_level=float(noise_level), shift=float(shift))
        self.eval_noise_scale = float(eval_noise_scale)
        self.rollout_noise_scale = float(rollout_noise_scale)
        self.executed_chunk_length = executed_chunk_length
        self.default_interaction_type = ExplorationType(default_interaction_type)

    def __setattr__(self, name, value):
        if name in _SAMPLER_PARAMETERS and "num_steps" in self.__dict__:
            # Checked with the other sampler parameters before the change: a refused value
            # leaves the policy as it was.
            current = {key: getattr(self, key) for key in _SAMPLER_PARAMETERS}
            self._check_sampler({**current, name: value})
            self.__dict__["_schedules"] = {}
        if name == "noise_head" and value is not None:
            self._check_declared_shape(value, "noise_head")
        super().__setattr__(name, value)
        if name == "noise_head":  # the written keys follow: step_std with a head only
            self._set_out_keys()

    def _check_declared_shape(self, network: object, name: str) -> None:
        """Refuse a network that declares an ``action_shape`` other than the policy's."""
        declared = getattr(network, "action_shape", None)
        if isinstance(declared, Sequence) and tuple(declared) not in (
            tuple(self.action_shape),
            tuple(self.chunk_shape),
        ):
            raise ValueError(
                f"{name} was built for action_shape {tuple(declared)}, but the "
                f"policy has action_shape {tuple(self.action_shape)}: it would reshape chunks "
                f"{tuple(self.chunk_shape)} silently. Build the network with the policy's "
                f"action_shape (chunk_shape {tuple(self.chunk_shape)} for a single-step policy)."
            )

    def _set_out_keys(self) -> None:
        """``out_keys``: the entries written under RANDOM exploration (``step_std`` only with
        a noise head)."""
        names = [f.name for f in dataclasses.fields(self.tensor_keys)]
        if self.noise_head is None:
            names.remove("step_std")
        self.out_keys = [getattr(self.tensor_keys, name) for name in names]

    def _check_sampler(self, sampler: dict) -> None:
        """Validate the sampler parameters together (``ValueError`` naming the argument).

        :func:`flow.check_sampler <torchrl_flowpolicy.flow.check_sampler>` for the rollouts'
        sampler (which also warns about steps that explode), then ``eval_num_steps`` and its
        grid; the grids are checked in the chain's dtype (:attr:`network_dtype`, widened).
        """
        dtype = flow.probability_dtype(self.network_dtype)
        flow.check_sampler(
            sampler["num_steps"],
            sampler["noise_level"],
            sampler["sde_mode"],
            sampler["num_sde_steps"],
            sampler["shift"],
            sampler["noise_schedule"],
            dtype=dtype,
        )
        flow.check_integer("eval_num_steps", sampler["eval_num_steps"], 1)
        try:
            flow.sigma_grid(sampler["eval_num_steps"], sampler["shift"], dtype=dtype)
        except ValueError as error:
            raise ValueError(f"eval_num_steps={sampler['eval_num_steps']}: {error}") from None

    # ------------------------------------------------------------------ shapes, keys, specs
    @property
    def single_step(self) -> bool:
        """Whether the policy acts one step at a time (``action_shape = (D,)``)."""
        return len(self.action_shape) == 1

    @property
    def chunk_shape(self) -> torch.Size:
        """``(H, D)``, the shape of one decision's ``x_k`` for the velocity network.

        ``action_shape`` itself for a chunk policy, ``(1, D)`` for a single-step policy.
        """
        return torch.Size((1, *self.action_shape)) if self.single_step else self.action_shape

    def _action(self, chunk: Tensor) -> Tensor:
        """The executed rows ``[N, H', D]`` of chunks ``[N, H, D]`` (``[N, D]`` single-step)."""
        if self.single_step:
            return chunk[:, 0]
        return chunk[:, : self.executed_chunk_length]

    def _stored_chain(self, chain: Tensor) -> Tensor:
        """The chain as stored, ``[N, K+1, *action_shape]``, from ``[N, K+1, H, D]``."""
        return chain[:, :, 0] if self.single_step else chain

    def set_keys(self, **kwargs: NestedKey) -> None:
        """Rename the entries the policy writes (see :class:`FlowSDEPolicy._AcceptedKeys`).

        A loss built on the policy afterwards reads the new names
        (:class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss` copies them at
        construction).

        Examples:
            >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
            >>> policy = FlowSDEPolicy(MLPVelocityNetwork(5, (4, 2)), action_shape=(4, 2))
            >>> policy.set_keys(chain=("rollout", "chain"))
            >>> policy.tensor_keys.chain
            ('rollout', 'chain')
        """
        fields = [f.name for f in dataclasses.fields(self.tensor_keys)]
        for name, key in kwargs.items():
            if name not in fields:
                raise ValueError(f"{name!r} is not a key of FlowSDEPolicy; accepted: {fields}.")
            setattr(
                self.tensor_keys, name, getattr(self.default_keys(), name) if key is None else key
            )
        self._set_out_keys()

    @property
    def log_prob_keys(self) -> list[NestedKey]:
        """The per-decision log-prob key, where TorchRL's PPO losses look for it."""
        return [self.tensor_keys.log_prob]

    @property
    def dist_sample_keys(self) -> list[NestedKey]:
        """The action key, where TorchRL's PPO losses look for it."""
        return [self.tensor_keys.action]

    @property
    def network_dtype(self) -> torch.dtype:
        """The dtype of the velocity network's parameters (float32 when it has none)."""
        return _parameter_dtype(self.velocity_network)

    @property
    def spec(self) -> Composite:
        """The entries written under RANDOM exploration, for one decision.

        Collectors read it to pre-allocate their buffers. Where a wrapper hides it
        (``compile_policy`` / ``cudagraph_policy``) they probe the policy outside any
        exploration context instead, which writes the same entries with the default
        ``default_interaction_type`` (RANDOM).
        """
        dtype = flow.probability_dtype(self.network_dtype)
        parameter = next(iter(getattr(self.velocity_network, "parameters", list)()), None)
        device = None if parameter is None else parameter.device
        action_dim = self.action_shape[-1]
        executed_shape = (
            (action_dim,) if self.single_step else (self.executed_chunk_length, action_dim)
        )
        keys, num_steps = self.tensor_keys, self.num_steps
        spec = Composite(device=device)
        spec[keys.action] = Unbounded(executed_shape, dtype=dtype, device=device)
        spec[keys.chain] = Unbounded(
            (num_steps + 1, *self.action_shape), dtype=dtype, device=device
        )
        spec[keys.sde_mask] = Binary(num_steps, dtype=torch.bool, device=device)
        spec[keys.step_log_prob] = Unbounded((num_steps,), dtype=dtype, device=device)
        spec[keys.log_prob] = Unbounded((), dtype=dtype, device=device)
        if self.noise_head is not None:
            spec[keys.step_std] = Unbounded(
                (num_steps, *self.action_shape), dtype=dtype, device=device
            )
        return spec

    # ------------------------------------------------------------------ context and velocity
    def schedule(
        self, num_steps: int, dtype: torch.dtype, device: torch.device
    ) -> SamplingSchedule:
        """The sampling schedule of ``num_steps`` steps (cached per dtype and device).

        With a noise head, that of the Euler ODE (``noise_level = 0``): its stochastic steps
        keep the ODE mean and take their std from the head.
        """
        learned = self.noise_head is not None
        key = (num_steps, dtype, device, learned)
        schedules = self.__dict__.setdefault("_schedules", {})
        if key not in schedules:
            schedules[key] = flow.sampling_schedule(
                num_steps,
                0.0 if learned else self.noise_level,
                self.shift,
                self.noise_schedule,
                dtype=dtype,
                device=device,
            )
        return schedules[key]

    def _flat(self, tensordict: TensorDictBase, key: NestedKey, what: str) -> Tensor:
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"FlowSDEPolicy needs {key!r} ({what}), which is missing from the tensordict "
                f"(keys: {list(tensordict.keys(True, True))})."
            )
        if tensordict.batch_dims == 0:
            return value.unsqueeze(0)
        return value.flatten(0, tensordict.batch_dims - 1)

    def context(self, tensordict: TensorDictBase, *, grad: bool = True) -> Context:
        """The per-decision context for the flattened batch ``[N, ...]``.

        The encoder's output, or the observation itself (a tuple when there are several
        observation keys) without an encoder. With ``grad=False`` the encoder runs under
        ``no_grad`` (the learner's default: the policy gradient stops at the context).
        """
        what = "an observation; pass in_keys=[...] naming the observation entries"
        observations = [self._flat(tensordict, key, what) for key in self.in_keys]
        if self.encoder is None:
            return observations[0] if len(observations) == 1 else tuple(observations)
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            return self.encoder(*observations)

    # ------------------------------------------------------------------ sampling
    def _sample(
        self, context: Context, num_decisions: int, device: torch.device
    ) -> dict[str, Tensor]:
        """One RANDOM chain per decision: the entries of the table above, flattened."""
        dtype = flow.probability_dtype(self.network_dtype)
        num_steps, executed = self.num_steps, self.executed_chunk_length
        noise = torch.randn(
            (num_decisions, num_steps + 1, *self.chunk_shape), dtype=dtype, device=device
        )
        sde_mask = flow.sample_sde_mask(
            (num_decisions,), num_steps, self.sde_mode, self.num_sde_steps, device=device
        )
        if self.rollout_noise_scale != 1.0:
            noise[:, 0] = noise[:, 0] * self.rollout_noise_scale
        if self.noise_level == 0 and self.noise_head is None:
            # No noise, no Gaussian step: the chain is the Euler ODE and has no density.
            sde_mask = torch.zeros_like(sde_mask)
        chain, means, schedule, step_std = self._integrate(
            context, noise[:, 0], num_steps, sde_mask, noise[:, 1:]
        )
        # The log-prob covers the executed rows only (all H rows by default).
        std = schedule.std if step_std is None else step_std
        step_log_prob = flow.chain_log_prob(chain, means, sde_mask, std, executed)
        keys = self.tensor_keys
        entries = {
            keys.action: self._action(chain[:, -1]),
            keys.chain: self._stored_chain(chain),
            keys.sde_mask: sde_mask,
            keys.step_log_prob: step_log_prob,
            keys.log_prob: step_log_prob.sum(-1),
        }
        if step_std is not None:
            entries[keys.step_std] = self._stored_chain(step_std)
        return entries

    def _integrate(
        self,
        context: Context,
        initial_noise: Tensor,
        num_steps: int,
        sde_mask: Tensor | None = None,
        step_noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, SamplingSchedule, Tensor | None]:
        """:func:`flow.integrate` with this policy's network, context, schedule and dtypes.

        Returns ``(chain, means, schedule, step_std)``; ``step_std`` (``[N, K, H, D]``) is
        the noise head's, ``None`` without a head or a mask.
        """
        network_dtype, dtype = self.network_dtype, initial_noise.dtype
        velocity = flow.network_velocity(self.velocity_network, context, network_dtype, dtype)
        schedule = self.schedule(num_steps, dtype, initial_noise.device)
        if self.noise_head is None or sde_mask is None:
            chain, means = flow.integrate(
                velocity, initial_noise, schedule, sde_mask, step_noise, sigma_dtype=network_dtype
            )
            return chain, means, schedule, None
        chain, means, step_std = flow.integrate(
            velocity,
            initial_noise,
            schedule,
            sde_mask,
            step_noise,
            sigma_dtype=network_dtype,
            noise_std=self._noise_std(context, dtype),
        )
        return chain, means, schedule, step_std

    def _noise_std(self, context: Context, dtype: torch.dtype) -> Callable[..., Tensor]:
        """The noise head as the ``noise_std`` callback of :mod:`flow` (its own dtype)."""
        head = self.noise_head
        return flow.network_velocity(head, context, _parameter_dtype(head), dtype, "noise_head")

    def _ode(self, context: Context, initial_noise: Tensor) -> Tensor:
        """The executed rows of the deterministic ODE chunk from ``x_0 = initial_noise``."""
        chain = self._integrate(context, initial_noise, self.eval_num_steps)[0]
        return self._action(chain[:, -1])

    @torch.no_grad()
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Sample chunks (see the class docstring); never tracks gradients.

        Gradients of the log-probabilities come from :meth:`log_prob` /
        :meth:`stochastic_steps`, which recompute them from the stored chain.
        """
        batch_shape = tensordict.batch_size
        context = self.context(tensordict)
        device = (context[0] if isinstance(context, tuple) else context).device
        num_decisions = math.prod(batch_shape)  # 1 for an unbatched tensordict, 0 if empty
        if (exploration_type() or self.default_interaction_type) == ExplorationType.RANDOM:
            entries = self._sample(context, num_decisions, device)
        else:
            dtype = flow.probability_dtype(self.network_dtype)
            # Drawn whatever the scale, so that the random stream does not depend on it.
            noise = torch.randn((num_decisions, *self.chunk_shape), dtype=dtype, device=device)
            if self.eval_noise_scale != 1.0:
                noise = noise * self.eval_noise_scale
            entries = {self.tensor_keys.action: self._ode(context, noise)}
        for key, value in entries.items():
            tensordict.set(key, value.reshape((*batch_shape, *value.shape[1:])))
        return tensordict

    @torch.no_grad()
    def decode(self, tensordict: TensorDictBase, initial_noise: Tensor) -> Tensor:
        """The executed rows ``[*B, H', D]`` of the ODE chunk (``eval_num_steps``) from
        ``x_0 = initial_noise [*B, H, D]``, for the observations of ``tensordict`` (DSRL).

        A single-step policy takes ``initial_noise [*B, D]`` and returns ``[*B, D]``.
        """
        batch_shape = tensordict.batch_size
        expected = (*batch_shape, *self.action_shape)
        if tuple(initial_noise.shape) != expected:
            raise ValueError(
                f"initial_noise has shape {tuple(initial_noise.shape)}, expected {expected} "
                f"(batch shape followed by action_shape {tuple(self.action_shape)})."
            )
        if not flow.all_finite(initial_noise):
            raise ValueError(
                f"initial_noise is not finite ({int((~torch.isfinite(initial_noise)).sum())} "
                f"NaN or inf values): the chunk decoded from it would be NaN."
            )
        noise = initial_noise.reshape(-1, *self.chunk_shape)
        action = self._ode(
            self.context(tensordict), noise.to(flow.probability_dtype(self.network_dtype))
        )
        return action.reshape((*batch_shape, *action.shape[1:]))

    # ------------------------------------------------------------------ learner
    def _stored(
        self, tensordict: TensorDictBase, key: NestedKey, trailing: tuple, *, chain: bool = False
    ) -> Tensor:
        value = self._flat(tensordict, key, "written by FlowSDEPolicy under RANDOM exploration")
        if tuple(value.shape[1:]) != trailing:
            hint = ""
            if chain and value.ndim == len(trailing) + 1 and value.shape[1] != trailing[0]:
                hint = (
                    f" The stored chain has K={value.shape[1] - 1} steps but the policy has "
                    f"num_steps={self.num_steps}: score it with a policy of the same num_steps."
                )
            raise ValueError(
                f"{key!r} has shape {tuple(tensordict.get(key).shape)}, expected "
                f"{(*tensordict.batch_size, *trailing)} (batch shape "
                f"{tuple(tensordict.batch_size)} followed by {trailing}).{hint}"
            )
        return value

    def stochastic_steps(
        self,
        tensordict: TensorDictBase,
        *,
        context_grad: bool = False,
        chain_key: NestedKey | None = None,
        sde_mask_key: NestedKey | None = None,
        check_data: bool = True,
    ) -> StochasticSteps:
        """The Gaussian transitions of the stored stochastic steps (:func:`flow.stochastic_steps`).

        One batched network call over all stochastic entries, gradient enabled (through the
        means); ``mean`` and ``sample`` are ``[M, H', D]`` (``[M, 1, D]`` for a single-step
        policy). With a noise head, one batched call of the head as well: ``std`` is then
        ``[M, H', D]`` under the current parameters, with its gradient (``[M]`` and
        parameter-free otherwise). ``context_grad`` lets it reach the encoder (through both
        networks); ``chain_key`` / ``sde_mask_key`` default to ``tensor_keys``.

        Raises a ``ValueError`` naming the key when the stored data cannot be scored: a mask
        that marks step 0 (``sigma = 1``, never stochastic), a non-finite stored sample
        ``x_{k+1}`` of a stochastic step (both checked unless ``check_data=False``), a
        non-finite stored ``x_k`` or velocity (always: the means are checked), a noise
        head's std that is not finite and > 0 (always).
        """
        num_steps = self.num_steps
        chain_key = chain_key or self.tensor_keys.chain
        sde_mask_key = sde_mask_key or self.tensor_keys.sde_mask
        chain = self._stored(
            tensordict, chain_key, (num_steps + 1, *self.action_shape), chain=True
        ).reshape(-1, num_steps + 1, *self.chunk_shape)
        sde_mask = self._stored(tensordict, sde_mask_key, (num_steps,))
        if check_data and sde_mask[:, 0].any():
            raise ValueError(
                f"the stored mask {sde_mask_key!r} marks step 0 as stochastic for "
                f"{int(sde_mask[:, 0].sum())} decisions: step 0 (sigma = 1) is never "
                f"stochastic (its SDE std is undefined). The data were not written by "
                f"FlowSDEPolicy, or were altered."
            )
        context = self.context(tensordict, grad=context_grad)
        network_dtype = self.network_dtype
        dtype = flow.probability_dtype(network_dtype)
        steps = flow.stochastic_steps(
            flow.network_velocity(self.velocity_network, context, network_dtype, dtype),
            chain.to(dtype),
            sde_mask,
            self.schedule(num_steps, dtype, chain.device),
            self.executed_chunk_length,
            None if self.noise_head is None else self._noise_std(context, dtype),
        )
        if self.noise_head is not None and not (
            flow.all_finite(steps.std) and bool((steps.std > 0).all())
        ):
            bad = ~(torch.isfinite(steps.std) & (steps.std > 0)).flatten(1).all(-1)
            raise ValueError(
                f"noise_head produced a std that is not finite and > 0 while recomputing "
                f"log-probs from the stored chain, at stochastic steps (decision, step) "
                f"{self._bad_entries(steps, bad)}: a noise head must return a positive std "
                f"(flow.bounded_std); check its inputs and dtype."
            )
        if not flow.all_finite(steps.mean):
            inputs = chain[steps.decision_index, steps.step_index]
            if not torch.isfinite(inputs).all():
                raise ValueError(
                    f"the stored chain {chain_key!r} is not finite at the inputs x_k of "
                    f"stochastic steps (decision, step) "
                    f"{self._bad_entries(steps, ~torch.isfinite(inputs).flatten(1).all(-1))}: "
                    f"the data were corrupted; drop them."
                )
            raise ValueError(
                "velocity_network produced non-finite values while recomputing log-probs "
                "from the stored chain (log_prob)."
            )
        if check_data and not flow.all_finite(steps.sample):
            bad = ~torch.isfinite(steps.sample).flatten(1).all(-1)
            raise ValueError(
                f"the stored chain {chain_key!r} is not finite at the samples x_(k+1) of "
                f"stochastic steps (decision, step) {self._bad_entries(steps, bad)}: the data "
                f"were corrupted; drop them."
            )
        return steps

    @staticmethod
    def _bad_entries(steps: StochasticSteps, bad: Tensor, limit: int = 3) -> str:
        """The first flattened ``(decision, step)`` pairs where ``bad [M]``, for messages."""
        pairs = torch.stack([steps.decision_index[bad], steps.step_index[bad]], -1)
        shown = ", ".join(str(tuple(pair)) for pair in pairs[:limit].tolist())
        return shown + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")

    def log_prob(self, tensordict: TensorDictBase, *, context_grad: bool = False) -> Tensor:
        """Per-step log-probs ``[*B, K]`` of a stored chain under the current parameters.

        Zero where a step was not stochastic. Recomputed with one batched network call over
        all stochastic entries (never a loop over ``K``), gradient enabled.
        """
        steps = self.stochastic_steps(tensordict, context_grad=context_grad)
        log_prob = flow.gaussian_log_prob(steps.sample, steps.mean, steps.std)
        return flow.scatter_steps(steps, log_prob, (*tensordict.batch_size, self.num_steps))
