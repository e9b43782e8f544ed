"""``DenoisingClipPPOLoss``: PPO's clipped objective per denoising step of a flow policy.

Each stochastic step ``k`` of decision ``t`` is a Gaussian transition
``x_{k+1} ~ N(mu_k(x_k; phi), std_k^2 I)`` (see :class:`~torchrl_flowpolicy.FlowSDEPolicy`).
With ``rho_{t,k} = exp(log N(x_{k+1}; mu_k^phi, std_k) - log N(x_{k+1}; mu_k^old, std_k))``
and the decision's advantage ``A_t`` broadcast over its stochastic steps,

``loss_objective = -mean_{(t,k) stochastic} min(rho A_t, clip(rho, 1 - eps_low, 1 + eps_high) A_t)``

(DPPO, Ren et al., 2024; pi-RL, Chen et al., 2025; Flow-GRPO, Liu et al., 2025). The mean
runs over the stochastic entries only: deterministic steps add neither to the objective,
nor to its normalisation, nor to the diagnostics.

Built on ``ClipPPOLoss``'s hooks: ``DenoisingClipPPOLoss._log_weight`` (PPO's log-prob hook) gives the
per-step log-weight ``[*B, K, 1]`` (0 at deterministic steps) from one batched network
call, TorchRL's ``_broadcast_advantage_to_log_weight`` spreads the advantage over the
steps and ``_reduce_loss`` reduces with the stochastic-step mask. TorchRL's, unchanged:
the critic loss and value clipping, advantage normalisation, ``make_value_estimator``
(GAE at the decision level), ``max_importance_ratio``, ``separate_losses``, reductions,
functional parameters, the clip buffers and ``_weighted_loss_entropy``. ``forward`` is a
composition of the surrogate (:func:`~torchrl_flowpolicy.objectives.surrogate.clipped_surrogate`,
with dual clip), the extra terms and the diagnostics over the stochastic entries
(:func:`~torchrl_flowpolicy.objectives.surrogate.ratio_diagnostics`); ``docs/dropin.md``
names the TorchRL hook that would make it TorchRL's own.

Entropy (off unless an ``entropy_coeff > 0`` is passed): a step's Gaussian entropy over its ``H' x D`` real entries,
averaged over the stochastic entries (``"entropy"``). With the fixed schedule it has no
gradient (exploration is the policy's ``noise_level``); with a noise head (Flow-Noise,
ReinFlow) the ratio includes the change of std and ``entropy_bonus=True`` is a real
bonus reaching the head. ``"loss_entropy"`` is always written (a zero without the bonus),
so that TorchRL's scripts can sum every ``loss_*`` entry.

Critic-free (``critic_network=None``, e.g. group-relative PPO with
:class:`~torchrl_flowpolicy.objectives.GroupRelativeAdvantage`): the advantage is read
from the batch, no ``loss_critic`` is written, the ``in_keys`` have no next-step entries,
and critic options (``critic_coeff > 0``, ``clip_value``, ``loss_critic_type``,
``make_value_estimator``, ``loss_critic``) raise a ``ValueError`` naming them.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives import ClipPPOLoss, ValueEstimators
from torchrl.objectives.ppo import _broadcast_advantage_to_log_weight, _check_advantage_broadcast

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import StochasticSteps
from torchrl_flowpolicy.objectives.checks import (
    check_advantage,
    check_loss_options,
    check_objective,
    no_critic_error,
    resolve_entropy_bonus,
    stored_step_log_prob,
)
from torchrl_flowpolicy.objectives.flow_matching import reduce_self_imitation, self_imitation_error
from torchrl_flowpolicy.objectives.surrogate import Surrogate, clipped_surrogate, ratio_diagnostics
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import KLEstimator

__all__ = ["DenoisingClipPPOLoss"]

#: The loss's parameter entries whose weak references TorchRL clears after a call.
_PARAMETER_ENTRIES = ("actor_network_params", "critic_network_params")
_PARAMETER_ENTRIES += ("target_actor_network_params", "target_critic_network_params")


class DenoisingClipPPOLoss(ClipPPOLoss):
    """PPO's clipped objective per (decision, stochastic denoising step) of a flow policy.

    The objective, the hooks it is built on, the entropy and the critic-free mode are
    described in the module's docstring (:mod:`torchrl_flowpolicy.objectives.ppo`).

    Args:
        actor_network: the :class:`~torchrl_flowpolicy.FlowSDEPolicy` to train.
        critic_network: a value network writing ``"state_value"``; ``None`` (default): no
            critic (see above).

    Keyword Args:
        clip_epsilon: a float in ``(0, 1)``, or a ``(low, high)`` pair (clip-higher ``(0.2, 0.28)``).
        dual_clip: ``c > 1``: dual-clip PPO (Ye et al., 2020); ``None`` (default): off.
        context_grad: let the policy gradient reach the encoder (default ``False``).
        kl_coeff: weight of the KL to a frozen reference actor (default 0: off).
        kl_estimator: ``"analytic"`` (default): the closed-form KL of the two Gaussian steps
            (:func:`flow.gaussian_kl <torchrl_flowpolicy.flow.gaussian_kl>`); ``"sample"``:
            ``log pi - log pi_ref`` at the stored samples.
        reference_actor: the frozen reference (default: a copy of ``actor_network``).
        bc_coeff: weight of self-imitation: flow matching on the executed chunks of the
            decisions flagged successful (key ``success``). Default 0: off.
        sigma_distribution: the noise-level distribution of the self-imitation term.
        entropy_bonus: add ``-entropy_coeff * entropy``; default: when an ``entropy_coeff > 0``
            is passed. ``False`` with an ``entropy_coeff > 0`` is refused, naming both.
        check_data: check the stored data before using them (default ``True``): a finite
            advantage, finite stored log-probs and samples, no stochastic step 0, a finite
            ``loss_objective``; a ``ValueError`` naming the key instead of NaN weights. One sum
            per tensor (``docs/reliability.md``).
        **kwargs: forwarded to :class:`~torchrl.objectives.ClipPPOLoss` (``critic_coeff``,
            ``normalize_advantage``, ``max_importance_ratio``, ``reduction``, ...).

    Keys (``set_keys``): TorchRL's (``sample_log_prob`` is the per-decision log-prob) plus
    ``step_log_prob``, ``chain``, ``sde_mask`` and ``success``; the policy's key names are
    copied at construction.

    Outputs (each explained in ``docs/dropin.md``): ``loss_objective``, ``loss_critic`` (with a
    critic), ``loss_kl`` (``kl_coeff > 0``), ``loss_bc`` (``bc_coeff > 0``), ``loss_entropy``;
    diagnostics ``clip_fraction``, ``kl_approx``, ``ESS``, ``mean_ratio``, ``max_ratio``,
    ``explained_variance``, ``entropy``, ``kl_reference``, ``log_prob_drift`` (the largest
    ``|logp_new - logp_old|``: a rollout/learner mismatch alarm) and ``num_stochastic_steps``;
    without any stochastic entry, the losses are 0 and the diagnostics those of unit ratios.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl.envs.utils import ExplorationType, set_exploration_type
        >>> from torchrl_flowpolicy import FlowSDEPolicy
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> policy = FlowSDEPolicy(MLPVelocityNetwork(5, (4, 2)), action_shape=(4, 2))
        >>> data = TensorDict({"observation": torch.randn(16, 5)}, batch_size=[16])
        >>> with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        ...     data = policy(data)
        >>> data["advantage"] = torch.randn(16, 1)
        >>> loss = DenoisingClipPPOLoss(policy, clip_epsilon=(0.2, 0.28))
        >>> out = loss(data)
        >>> out["loss_objective"].backward()
        >>> bool(out["log_prob_drift"] < 1e-5)
        True
    """

    @dataclass
    class _AcceptedKeys(ClipPPOLoss._AcceptedKeys):
        """TorchRL's keys plus the chain's: ``step_log_prob`` ``[*B, K]``, ``chain``
        ``[*B, K+1, H, D]`` (``[*B, K+1, D]`` for a single-step policy), ``sde_mask`` ``[*B, K]``
        (defaults: the policy's) and ``success`` ``[*B]`` or ``[*B, 1]`` (self-imitation;
        default ``"success"``)."""

        step_log_prob: NestedKey = ("flow", "step_log_prob")
        chain: NestedKey = ("flow", "chain")
        sde_mask: NestedKey = ("flow", "sde_mask")
        success: NestedKey = "success"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    actor_network: FlowSDEPolicy
    critic_network: TensorDictModule

    def __init__(
        self,
        actor_network: FlowSDEPolicy,
        critic_network: TensorDictModule | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        dual_clip: float | None = None,
        context_grad: bool = False,
        kl_coeff: float = 0.0,
        kl_estimator: KLEstimator = "analytic",
        reference_actor: FlowSDEPolicy | None = None,
        bc_coeff: float = 0.0,
        sigma_distribution: flow.SigmaDistribution = "uniform",
        entropy_bonus: bool | None = None,
        check_data: bool = True,
        **kwargs: Any,
    ):
        coefficients = (kl_coeff, bc_coeff, kl_estimator)
        check_loss_options(
            actor_network, critic_network, clip_epsilon, dual_clip, *coefficients, kwargs
        )
        if kl_coeff > 0 and reference_actor is None:
            reference_actor = copy.deepcopy(actor_network)
        entropy_bonus = resolve_entropy_bonus(entropy_bonus, kwargs)
        options = {"clip_epsilon": clip_epsilon, "entropy_bonus": entropy_bonus, **kwargs}
        super().__init__(actor_network, critic_network, **options)
        if reference_actor is not None:
            reference_actor = reference_actor.requires_grad_(False).eval()
        self.reference_actor = reference_actor
        self.dual_clip, self.context_grad, self.check_data = dual_clip, context_grad, check_data
        self.kl_coeff, self.kl_estimator, self.bc_coeff = kl_coeff, kl_estimator, bc_coeff
        self.sigma_distribution = sigma_distribution
        keys = actor_network.tensor_keys  # the policy's names, copied
        self.set_keys(action=keys.action, sample_log_prob=keys.log_prob, chain=keys.chain)
        self.set_keys(step_log_prob=keys.step_log_prob, sde_mask=keys.sde_mask)

    def _set_in_keys(self) -> None:
        super()._set_in_keys()
        keys = set(self._in_keys)
        if self.critic_network is None:  # the advantage is read, not estimated: no next step
            keys = set(self.actor_network.in_keys)
            keys.update({self.tensor_keys.action, self.tensor_keys.sample_log_prob})
            keys.add(self.tensor_keys.advantage)
        keys.update({self.tensor_keys.chain, self.tensor_keys.sde_mask})
        keys.add(self.tensor_keys.step_log_prob)
        if getattr(self, "bc_coeff", 0.0) > 0:
            keys.add(self.tensor_keys.success)
        self._in_keys = list(keys)

    @property
    def out_keys(self) -> list[NestedKey]:
        if self._out_keys is None:
            keys = ["loss_objective", *["loss_critic"] * self._has_critic]
            keys += ["loss_kl"] * (self.kl_coeff > 0) + ["loss_bc"] * (self.bc_coeff > 0)
            keys.append("loss_entropy")
            keys += ["clip_fraction", "kl_approx", "ESS", "mean_ratio", "max_ratio"]
            keys += ["entropy", "log_prob_drift", "log_prob_drift_relative"]
            keys.append("num_stochastic_steps")
            self._out_keys = keys
        return self._out_keys

    @out_keys.setter
    def out_keys(self, values) -> None:
        self._out_keys = values

    def make_value_estimator(self, value_type: ValueEstimators | None = None, **hyperparams: Any):
        """TorchRL's ``make_value_estimator``; refused without a critic."""
        if self.critic_network is None:
            raise no_critic_error("make_value_estimator")
        return super().make_value_estimator(value_type, **hyperparams)

    def loss_critic(
        self, tensordict: TensorDictBase
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """TorchRL's ``loss_critic``; refused without a critic."""
        if self.critic_network is None:
            raise no_critic_error("loss_critic")
        return super().loss_critic(tensordict)

    def _actor_parameters(self):
        if self.functional:
            return self.actor_network_params.to_module(
                self.actor_network, preserve_module_state=False
            )
        return contextlib.nullcontext()

    def stochastic_steps(self, tensordict: TensorDictBase) -> StochasticSteps:
        """The actor's Gaussian steps of the stored chain, under the loss's parameters."""
        with self._actor_parameters():
            return self.actor_network.stochastic_steps(
                tensordict,
                context_grad=self.context_grad,
                chain_key=self.tensor_keys.chain,
                sde_mask_key=self.tensor_keys.sde_mask,
                check_data=self.check_data,
            )

    def old_step_log_prob(self, tensordict: TensorDictBase, steps: StochasticSteps) -> Tensor:
        """The stored log-probs of the stochastic entries, ``[M]`` (checked)."""
        key, num_steps = self.tensor_keys.step_log_prob, self.actor_network.num_denoising_steps
        return stored_step_log_prob(tensordict, key, steps, num_steps, self.check_data)

    def _log_weight(
        self, tensordict: TensorDictBase, adv_shape: torch.Size
    ) -> tuple[Tensor, StochasticSteps, Tensor, Tensor | None]:
        """PPO's log-prob hook, per denoising step.

        Returns ``(log_weight, steps, kl_approx, log_is_weight)``, TorchRL's tuple with the
        stochastic steps in the distribution's place: ``log_weight = log pi_theta -
        log pi_old`` per (decision, step), ``[*B, K, 1]``, zero at deterministic steps;
        ``kl_approx = -log_weight``; ``log_is_weight`` caps every step's ratio at
        ``max_importance_ratio`` as TorchRL does (``None`` without a cap).
        """
        log_weight, steps, _, log_is_weight = self._step_log_weight(tensordict, adv_shape)
        return log_weight, steps, -log_weight, log_is_weight

    def _step_log_weight(
        self, tensordict: TensorDictBase, adv_shape: torch.Size
    ) -> tuple[Tensor, StochasticSteps, Tensor, Tensor | None]:
        """:meth:`_log_weight`'s terms with ``|log pi_old|`` ``[*B, K]`` for ``kl_approx``."""
        steps = self.stochastic_steps(tensordict)
        log_prob = self.actor_network.sampler.log_prob(steps)
        old = self.old_step_log_prob(tensordict, steps).to(log_prob.dtype)
        shape = (*adv_shape, self.actor_network.num_denoising_steps)
        log_weight = flow.scatter_steps(steps, log_prob - old, shape).unsqueeze(-1)
        old_magnitude = flow.scatter_steps(steps, old.detach().abs(), shape)  # 0 where ODE
        cap = self.max_importance_ratio
        log_is_weight = None if cap is None else (cap.log() - log_weight.detach()).clamp_max(0)
        return log_weight, steps, old_magnitude, log_is_weight

    def advantage(self, tensordict: TensorDictBase) -> Tensor:
        """The decision's advantage ``[*B, 1]`` (from the value estimator if missing),
        checked and normalised as TorchRL does (``_maybe_normalize_advantage``)."""
        advantage = tensordict.get(self.tensor_keys.advantage, None)
        update_norm = advantage is None
        if advantage is None:
            if self.critic_network is None:
                raise KeyError(
                    f"the advantage {self.tensor_keys.advantage!r} is missing and there is no "
                    f"critic to compute it: write it first (GroupRelativeAdvantage, a TorchRL "
                    f"value estimator) or pass a critic."
                )
            self.value_estimator(
                tensordict,
                params=self._cached_critic_network_params_detached,
                target_params=self.target_critic_network_params,
            )
            advantage = tensordict.get(self.tensor_keys.advantage)
        source = "the value estimator wrote it" if update_norm else "it was in the input"
        check_advantage(advantage, self.tensor_keys.advantage, tensordict, source, self.check_data)
        return self._maybe_normalize_advantage(advantage, tensordict, update_norm=update_norm)

    def reduce_steps(self, values: Tensor, sde_mask: Tensor, tensordict: TensorDictBase) -> Tensor:
        """Reduce per-step ``values [*B, K]`` over the stochastic entries with ``reduction``.

        ``"none"`` gives a ``[*B, K]`` tensor, zero at the deterministic steps. TorchRL's
        validity masks (``loss_mask_key``) are honoured.
        """
        values = torch.where(sde_mask, values, torch.zeros_like(values))
        if self.reduction == "none":
            # Validity masks read from the input zero their entries and keep the shape.
            return self._reduce_loss(values, tensordict)
        return self._reduce_loss(values, tensordict, mask=sde_mask)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tensordict = tensordict.clone(False)
        advantage = self.advantage(tensordict)
        batch_shape = tensordict.batch_size
        log_weight, steps, old, log_is_weight = self._step_log_weight(tensordict, batch_shape)
        advantage = _broadcast_advantage_to_log_weight(advantage, log_weight)
        _check_advantage_broadcast(advantage, log_weight)
        surrogate = clipped_surrogate(
            log_weight, advantage, self._clip_bounds, log_is_weight, self.dual_clip
        )
        sde_mask = flow.scatter_steps(
            steps, torch.ones_like(steps.step_index, dtype=torch.bool), log_weight.shape[:-1]
        )
        objective = self._objective(surrogate, advantage, sde_mask, tensordict)
        out = TensorDict({"loss_objective": objective})
        if self._has_critic:
            self._add_critic_terms(tensordict, out)
        if self.kl_coeff > 0:
            kl = self._reference_kl(tensordict, steps)
            out.set("loss_kl", self.kl_coeff * self._entry_mean(kl, steps, sde_mask, tensordict))
            out.set("kl_reference", kl.detach().mean() if kl.numel() else kl.new_zeros(()))
        if self.bc_coeff > 0:
            out.set("loss_bc", self.bc_coeff * self._self_imitation(tensordict))
        entropy = self.actor_network.sampler.entropy(steps)
        loss_entropy = torch.zeros_like(objective)  # no bonus: for scripts summing every loss_*
        if self.entropy_bonus:  # -entropy_coeff * entropy
            mean_entropy = self._entry_mean(entropy, steps, sde_mask, tensordict)
            loss_entropy = self._weighted_loss_entropy(mean_entropy)
        out.set("loss_entropy", loss_entropy)
        for name, value in ratio_diagnostics(surrogate, sde_mask, entropy, old).items():
            out.set(name, value)
        self._clear_weakrefs(tensordict, out, *_PARAMETER_ENTRIES)
        return out

    def _objective(
        self, surrogate: Surrogate, advantage: Tensor, sde_mask: Tensor, tensordict: TensorDictBase
    ) -> Tensor:
        """``loss_objective``: the negative gain reduced over the stochastic entries."""
        loss_objective = self.reduce_steps(-surrogate.gain[..., 0], sde_mask, tensordict)
        if self.check_data:
            check_objective(loss_objective, advantage, surrogate.log_weight)
        return loss_objective

    def _add_critic_terms(self, tensordict: TensorDictBase, out: TensorDictBase) -> None:
        """TorchRL's ``loss_critic`` (reduced) with its clip fraction and explained variance."""
        loss_critic, value_clip_fraction, explained_variance = self.loss_critic(tensordict)
        out.set("loss_critic", self._reduce_loss(loss_critic, tensordict).squeeze(-1))
        if value_clip_fraction is not None:
            out.set("value_clip_fraction", value_clip_fraction)
        if explained_variance is not None:
            out.set("explained_variance", explained_variance.squeeze(-1))

    def _entry_mean(
        self, values: Tensor, steps: StochasticSteps, sde_mask: Tensor, td: TensorDictBase
    ) -> Tensor:
        """Per-entry ``values [M]`` reduced over the stochastic entries (:meth:`reduce_steps`)."""
        return self.reduce_steps(flow.scatter_steps(steps, values, sde_mask.shape), sde_mask, td)

    def _reference_kl(self, tensordict: TensorDictBase, steps: StochasticSteps) -> Tensor:
        """Per-entry ``KL(pi || pi_ref)`` of the stochastic steps, ``[M]``."""
        with torch.no_grad():
            reference = self.reference_actor.stochastic_steps(
                tensordict,
                chain_key=self.tensor_keys.chain,
                sde_mask_key=self.tensor_keys.sde_mask,
            )
        return self.actor_network.sampler.kl(steps, reference, self.kl_estimator)

    def _self_imitation(self, tensordict: TensorDictBase) -> Tensor:
        with self._actor_parameters():
            error, success = self_imitation_error(
                self.actor_network,
                tensordict,
                success_key=self.tensor_keys.success,
                action_key=self.tensor_keys.action,
                sigma_distribution=self.sigma_distribution,
                context_grad=self.context_grad,
            )
        return reduce_self_imitation(error, success, self.reduction)
