"""``FlowSDEPolicy``: a flow-matching action head as a scorable stochastic TorchRL policy.

A TensorDict shell over :class:`~torchrl_flowpolicy.sampler.FlowSampler`: it maps keys to
tensors, dispatches on the exploration type and declares its spec; sampling, rescoring,
settings and dtypes are the sampler's (``policy.sampler``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor, nn
from torchrl.data import Binary, Composite, Unbounded
from torchrl.envs.utils import ExplorationType, exploration_type

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import StochasticSteps
from torchrl_flowpolicy.sampler import Context, FlowSampler, SamplerOptions
from torchrl_flowpolicy.sampler_options import refuse_setting_attribute

__all__ = ["FlowSDEPolicy"]

#: Attributes of the sampler that the policy reads and sets through (``policy.options = ...``).
_SAMPLER_ATTRIBUTES = {"velocity_network", "encoder", "noise_head", "options"}
_SAMPLER_ATTRIBUTES.add("executed_chunk_length")


def _upgrade_state_dict(module, state_dict, prefix, *args) -> None:
    """Load a checkpoint written before the sampler held the networks (``velocity_network.*``
    at the policy's root): its keys move under ``sampler.``."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        name = key[len(prefix) :]
        if name.split(".")[0] in ("velocity_network", "encoder", "noise_head"):
            state_dict[f"{prefix}sampler.{name}"] = state_dict.pop(key)


def _delegated(name: str, doc: str) -> property:
    """A read-only property reading the sampler's attribute ``name``."""
    return property(lambda policy: getattr(policy.sampler, name), doc=doc)


class FlowSDEPolicy(TensorDictModuleBase):
    """A velocity network as a TorchRL policy sampling chunks with the Flow-SDE sampler.

    Under RANDOM exploration (collectors, and calls outside any exploration context: see
    ``default_interaction_type``) it writes a rollout chain of :meth:`FlowSampler.sample
    <torchrl_flowpolicy.sampler.FlowSampler.sample>` (``[*B]`` the batch shape; the keys are
    renamed with :meth:`set_keys`):

    | key (``set_keys`` name) | shape | meaning |
    | --- | --- | --- |
    | ``"action"`` (``action``) | ``[*B, H', D]`` | executed rows of ``x_K`` (unclamped) |
    | ``("flow", "chain")`` (``chain``) | ``[*B, K+1, H, D]`` | ``x_0 .. x_K`` |
    | ``("flow", "sde_mask")`` (``sde_mask``) | ``[*B, K]`` bool | which steps were stochastic |
    | ``("flow", "step_log_prob")`` (``step_log_prob``) | ``[*B, K]`` | per-step log-prob, 0 where ODE |
    | ``"action_log_prob"`` (``log_prob``) | ``[*B]`` | sum over the steps |
    | ``("flow", "step_std")`` (``step_std``) | ``[*B, K, H, D]`` | with a ``noise_head`` only: each step's std, 0 where ODE |

    Under DETERMINISTIC / MODE / MEAN exploration it writes the action only: the ODE with
    ``eval_num_denoising_steps`` from ``x_0 = eval_noise_scale * N(0, I)`` (scale 0, the
    default: the noise-free chunk). ``H' = executed_chunk_length`` of the ``H`` rows are
    executed and scored. A single-step policy (``action_shape=(D,)``, for an unwrapped
    environment) writes ``"action"`` ``[*B, D]`` and the chain ``[*B, K+1, D]``. The context is
    computed once per decision. pi-RL's mixed ODE/SDE sampler (Chen et al., 2025) with
    Flow-GRPO's schedule (Liu et al., 2025) and DPPO's step log-probs (Ren et al., 2024).

    Args:
        velocity_network: ``velocity_network(x [N, H, D], sigma [N], context) -> v [N, H, D]``,
            or a ready :class:`~torchrl_flowpolicy.sampler.FlowSampler` (then give only
            ``action_shape``, ``in_keys`` and ``default_interaction_type``).

    Keyword Args:
        action_shape: ``(H, D)``, the chunk shape; or ``(D,)``, a single-step policy.
        in_keys: observation keys read from the tensordict.
        encoder: as for :class:`~torchrl_flowpolicy.sampler.FlowSampler`.
        noise_head: as for :class:`~torchrl_flowpolicy.sampler.FlowSampler`.
        options: a :class:`~torchrl_flowpolicy.sampler.SamplerOptions`, the one route for
            settings.
        executed_chunk_length: as for :class:`~torchrl_flowpolicy.sampler.FlowSampler`.
        action_mask: as for :class:`~torchrl_flowpolicy.sampler.FlowSampler`.
        network_dtype: as for :class:`~torchrl_flowpolicy.sampler.FlowSampler`.
        default_interaction_type: the mode outside an exploration context; RANDOM, as TorchRL's
            PPO actors (a collector that probes the policy then sees the chain).

    The sampler's attributes read through (``policy.options``); setting one goes through its
    checks (``policy.options = policy.options.replace(noise_level=0.3)``,
    ``policy.noise_head = NoiseHead(...)``). A setting set as an attribute
    (``policy.eval_noise_scale = 1.0``, or a former name: ``policy.num_steps = 4``) raises an
    ``AttributeError`` naming that fix instead of creating an attribute nothing reads; it is not
    forwarded, so that settings change in one way, checked as a whole. Older checkpoints
    (networks at the root) load.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> policy = FlowSDEPolicy(MLPVelocityNetwork(5, (4, 2)), action_shape=(4, 2))
        >>> td = policy(TensorDict({"observation": torch.randn(3, 5)}, batch_size=[3]))
        >>> td["flow", "chain"].shape, td["action_log_prob"].shape
        (torch.Size([3, 9, 4, 2]), torch.Size([3]))
        >>> torch.testing.assert_close(policy.log_prob(td), td["flow", "step_log_prob"])
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
        velocity_network: FlowSampler | nn.Module | Callable[[Tensor, Tensor, Context], Tensor],
        *,
        action_shape: Sequence[int],
        in_keys: Sequence[NestedKey] = ("observation",),
        encoder: nn.Module | Callable[..., Context] | None = None,
        noise_head: nn.Module | Callable[[Tensor, Tensor, Context], Tensor] | None = None,
        options: SamplerOptions | None = None,
        executed_chunk_length: int | None = None,
        action_mask: Tensor | None = None,
        network_dtype: torch.dtype | None = None,
        default_interaction_type: ExplorationType = ExplorationType.RANDOM,
    ):
        super().__init__()
        if len(action_shape) not in (1, 2) or not all(int(size) >= 1 for size in action_shape):
            raise ValueError(
                f"action_shape must be (chunk_length H, action_dim D), or (action_dim D,) for a "
                f"single-step policy, with positive sizes; got {tuple(action_shape)}."
            )
        self.action_shape = torch.Size(action_shape)
        chunk_shape = (1, *action_shape) if len(action_shape) == 1 else tuple(action_shape)
        arguments = {"encoder": encoder, "noise_head": noise_head, "options": options}
        arguments |= {"executed_chunk_length": executed_chunk_length, "action_mask": action_mask}
        arguments |= {"network_dtype": network_dtype}
        if not isinstance(velocity_network, FlowSampler):
            velocity_network = FlowSampler(velocity_network, chunk_shape=chunk_shape, **arguments)
        elif (
            any(v is not None for v in arguments.values())
            or velocity_network.chunk_shape != chunk_shape
        ):
            raise ValueError(
                f"a ready FlowSampler carries its own networks and settings: pass only its "
                f"action_shape ({tuple(velocity_network.chunk_shape)}, or (D,) for a single-step "
                f"policy), in_keys and default_interaction_type."
            )
        self.sampler = velocity_network
        self.in_keys = list(in_keys)
        self.tensor_keys = self._AcceptedKeys()
        self._set_out_keys()
        self.default_interaction_type = ExplorationType(default_interaction_type)
        self.register_load_state_dict_pre_hook(_upgrade_state_dict)

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_setting_attribute("policy", name)
        if name in _SAMPLER_ATTRIBUTES and "sampler" in self._modules:
            setattr(self.sampler, name, value)
            if name == "noise_head":  # the written keys follow: step_std with a head only
                self._set_out_keys()
            return
        super().__setattr__(name, value)

    velocity_network = _delegated("velocity_network", "The velocity network.")
    encoder = _delegated("encoder", "The encoder (or ``None``).")
    noise_head = _delegated("noise_head", "The noise head (or ``None``); may be set.")
    options = _delegated("options", "The sampler's :class:`SamplerOptions`; may be set.")
    executed_chunk_length = _delegated("executed_chunk_length", "``H'``; may be set.")
    network_dtype = _delegated("network_dtype", "The velocity network's dtype.")

    @property
    def num_denoising_steps(self) -> int:
        """``K`` of the rollouts and of the learner's rescoring."""
        return self.sampler.options.num_denoising_steps

    @property
    def single_step(self) -> bool:
        """Whether the policy acts one step at a time (``action_shape = (D,)``)."""
        return len(self.action_shape) == 1

    @property
    def chunk_shape(self) -> torch.Size:
        """``(H, D)``, one decision's ``x_k``: ``(1, D)`` for a single-step policy."""
        return self.sampler.chunk_shape

    def _set_out_keys(self) -> None:
        names = [field.name for field in dataclasses.fields(self.tensor_keys)]
        if self.noise_head is None:
            names.remove("step_std")
        self.out_keys = [getattr(self.tensor_keys, name) for name in names]

    def set_keys(self, **kwargs: NestedKey) -> None:
        """Rename the entries the policy writes (``None`` restores a default): e.g.
        ``policy.set_keys(chain=("rollout", "chain"))``. A loss built afterwards reads them."""
        fields = [field.name for field in dataclasses.fields(self.tensor_keys)]
        for name, key in kwargs.items():
            if name not in fields:
                raise ValueError(f"{name!r} is not a key of FlowSDEPolicy; accepted: {fields}.")
            default = getattr(self.default_keys(), name)
            setattr(self.tensor_keys, name, default if key is None else key)
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
    def spec(self) -> Composite:
        """The entries written under RANDOM exploration, for one decision (collectors read it
        to pre-allocate their buffers)."""
        dtype, keys, total_steps = self.sampler.dtype, self.tensor_keys, self.num_denoising_steps
        parameter = next(iter(getattr(self.velocity_network, "parameters", list)()), None)
        device = None if parameter is None else parameter.device
        action_dim = self.action_shape[-1]
        executed = (action_dim,) if self.single_step else (self.executed_chunk_length, action_dim)
        spec, kind = Composite(device=device), {"dtype": dtype, "device": device}
        spec[keys.action] = Unbounded(executed, **kind)
        spec[keys.chain] = Unbounded((total_steps + 1, *self.action_shape), **kind)
        spec[keys.sde_mask] = Binary(total_steps, dtype=torch.bool, device=device)
        spec[keys.step_log_prob] = Unbounded((total_steps,), **kind)
        spec[keys.log_prob] = Unbounded((), **kind)
        if self.noise_head is not None:
            spec[keys.step_std] = Unbounded((total_steps, *self.action_shape), **kind)
        return spec

    def _flat(self, tensordict: TensorDictBase, key: NestedKey, what: str) -> Tensor:
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"FlowSDEPolicy needs {key!r} ({what}), which is missing from the tensordict "
                f"(keys: {list(tensordict.keys(True, True))})."
            )
        batch_dims = tensordict.batch_dims
        if batch_dims == 0:
            return value.unsqueeze(0)
        return value if batch_dims == 1 else value.flatten(0, batch_dims - 1)

    def context(self, tensordict: TensorDictBase, *, grad: bool = True) -> Context:
        """The per-decision context of the flattened batch ``[N, ...]``
        (:meth:`FlowSampler.context <torchrl_flowpolicy.sampler.FlowSampler.context>`)."""
        what = "an observation; pass in_keys=[...] naming the observation entries"
        return self.sampler.context(
            *(self._flat(tensordict, k, what) for k in self.in_keys), grad=grad
        )

    def stored_chain(
        self, tensordict: TensorDictBase, *, chain_key=None, sde_mask_key=None
    ) -> tuple[Tensor, Tensor]:
        """The stored chain ``[N, K+1, H, D]`` and mask ``[N, K]`` of the flattened batch (keys
        default to ``tensor_keys``; their shapes are checked by the sampler's rescoring)."""
        what = "written by FlowSDEPolicy under RANDOM exploration"
        chain = self._flat(tensordict, chain_key or self.tensor_keys.chain, what)
        sde_mask = self._flat(tensordict, sde_mask_key or self.tensor_keys.sde_mask, what)
        return (chain.unsqueeze(-2) if self.single_step else chain), sde_mask

    @torch.no_grad()
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Sample chunks (see the class docstring); never tracks gradients (they come from
        :meth:`log_prob` / :meth:`stochastic_steps`, which rescore the stored chain)."""
        batch_shape, keys = tensordict.batch_size, self.tensor_keys
        context = self.context(tensordict)
        num_decisions = math.prod(batch_shape)  # 1 for an unbatched tensordict, 0 if empty
        # A single-step policy stores one row: x_k [N, 1, D] as [N, D].
        rows = (lambda value: value.select(-2, 0)) if self.single_step else (lambda value: value)
        if (exploration_type() or self.default_interaction_type) == ExplorationType.RANDOM:
            sampled = self.sampler.sample(context, num_decisions)
            entries = {keys.action: rows(sampled.action), keys.chain: rows(sampled.chain)}
            entries |= {keys.sde_mask: sampled.sde_mask, keys.step_log_prob: sampled.step_log_prob}
            entries[keys.log_prob] = sampled.log_prob
            if sampled.step_std is not None:
                entries[keys.step_std] = rows(sampled.step_std)
        else:
            entries = {keys.action: rows(self.sampler.ode_sample(context, num_decisions))}
        reshape = tensordict.batch_dims != 1  # [N, ...] -> [*B, ...]
        for key, value in entries.items():
            tensordict.set(
                key, value.reshape((*batch_shape, *value.shape[1:])) if reshape else value
            )
        return tensordict

    @torch.no_grad()
    def decode(self, tensordict: TensorDictBase, initial_noise: Tensor) -> Tensor:
        """The executed rows ``[*B, H', D]`` of the ODE chunk (``eval_num_denoising_steps``) from
        ``x_0 = initial_noise [*B, H, D]`` for the observations of ``tensordict`` (DSRL);
        ``[*B, D]`` for a single-step policy."""
        batch_shape = tensordict.batch_size
        expected = (*batch_shape, *self.action_shape)
        if tuple(initial_noise.shape) != expected or not flow.all_finite(initial_noise):
            bad = int((~torch.isfinite(initial_noise)).sum())
            raise ValueError(
                f"initial_noise (shape {tuple(initial_noise.shape)}, {bad} values not finite) "
                f"must be finite, of shape {expected} (the batch shape, then action_shape)."
            )
        noise = initial_noise.reshape(-1, *self.chunk_shape).to(self.sampler.dtype)
        action = self.sampler.ode(self.context(tensordict), noise)
        action = action.select(-2, 0) if self.single_step else action
        return action.reshape((*batch_shape, *action.shape[1:]))

    def stochastic_steps(
        self,
        tensordict: TensorDictBase,
        *,
        context_grad: bool = False,
        chain_key: NestedKey | None = None,
        sde_mask_key: NestedKey | None = None,
        check_data: bool = True,
    ) -> StochasticSteps:
        """The Gaussian steps of the stored chain under the current parameters
        (:meth:`FlowSampler.rescore <torchrl_flowpolicy.sampler.FlowSampler.rescore>`, whose
        errors name the keys); ``context_grad`` lets the gradient reach the encoder."""
        chain_key = chain_key or self.tensor_keys.chain
        sde_mask_key = sde_mask_key or self.tensor_keys.sde_mask
        stored = self.stored_chain(tensordict, chain_key=chain_key, sde_mask_key=sde_mask_key)
        context = self.context(tensordict, grad=context_grad)
        names = {"chain_name": repr(chain_key), "sde_mask_name": repr(sde_mask_key)}
        return self.sampler.rescore(context, *stored, check_data=check_data, **names)

    def log_prob(self, tensordict: TensorDictBase, *, context_grad: bool = False) -> Tensor:
        """Per-step log-probs ``[*B, K]`` of the stored chain under the current parameters: 0
        where a step was not stochastic, one batched network call, gradient enabled."""
        steps = self.stochastic_steps(tensordict, context_grad=context_grad)
        shape = (*tensordict.batch_size, self.num_denoising_steps)
        return flow.scatter_steps(steps, self.sampler.log_prob(steps), shape)
