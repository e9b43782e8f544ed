"""``DenoisingClipPPOLoss``: PPO's clipped objective per denoising step of a flow policy."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives import ClipPPOLoss, ValueEstimators
from torchrl.objectives.ppo import _broadcast_advantage_to_log_weight, _check_advantage_broadcast

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import StochasticSteps
from torchrl_flowpolicy.objectives.flow_matching import self_imitation_error
from torchrl_flowpolicy.policy import FlowSDEPolicy

__all__ = ["DenoisingClipPPOLoss"]

KLEstimator = Literal["analytic", "sample"]


def _check_clip_epsilon(clip_epsilon: float | tuple[float, float]) -> None:
    """A number in ``(0, 1)``, or a ``(low, high)`` pair with ``0 <= low < 1``, ``high >= 0``.

    TorchRL validates the pair only; a scalar ``1.5`` would make ``log(1 - eps)`` NaN.
    """

    def number(value) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):
            return math.nan

    if isinstance(clip_epsilon, (tuple, list)):
        bounds = [number(eps) for eps in clip_epsilon]
        if len(bounds) != 2 or not (0 <= bounds[0] < 1 and 0 <= bounds[1] < math.inf):
            raise ValueError(
                f"clip_epsilon=(low, high) needs finite numbers with 0 <= low < 1 and "
                f"high >= 0, got {clip_epsilon!r}."
            )
    elif not 0 < number(clip_epsilon) < 1:
        raise ValueError(
            f"clip_epsilon must be in (0, 1) (the ratio is clipped to [1 - eps, 1 + eps]), got "
            f"{clip_epsilon!r}."
        )


# ClipPPOLoss options that only a critic serves (critic_coeff None or 0 means "no critic loss").
_CRITIC_OPTIONS = ("critic_coeff", "clip_value", "loss_critic_type")


def _check_critic_free(options: Mapping[str, Any]) -> None:
    """Refuse, without a critic, the options that configure one."""
    given = [
        f"{name}={options[name]!r}"
        for name in _CRITIC_OPTIONS
        if name in options
        and not (name == "critic_coeff" and options[name] in (None, 0))
        and not (name == "clip_value" and options[name] is None)
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)}: critic options, and there is no critic "
            f"(critic_network=None). A critic-free loss reads the advantage from the batch (e.g. "
            f"GroupRelativeAdvantage); drop these options or pass a critic_network."
        )


def _no_critic_error(what: str) -> ValueError:
    return ValueError(
        f"{what} needs a critic, and this loss has none (critic_network=None): the advantage "
        f"must be in the batch (e.g. written by GroupRelativeAdvantage). Pass a critic_network "
        f"to estimate it with TorchRL's value estimators."
    )


class DenoisingClipPPOLoss(ClipPPOLoss):
    """PPO's clipped objective taken per (decision, stochastic denoising step).

    Each stochastic step ``k`` of decision ``t`` is a Gaussian transition
    ``x_{k+1} ~ N(mu_k(x_k; phi), std_k^2 I)`` (see :class:`~torchrl_flowpolicy.FlowSDEPolicy`).
    With ``rho_{t,k} = exp(log N(x_{k+1}; mu_k^phi, std_k) - log N(x_{k+1}; mu_k^old, std_k))``
    and the decision's advantage ``A_t`` broadcast over its stochastic steps,

    ``loss_objective = -mean_{(t,k) stochastic} min(rho A_t, clip(rho, 1 - eps_low, 1 + eps_high) A_t)``

    (DPPO, Ren et al., 2024; pi-RL, Chen et al., 2025; Flow-GRPO, Liu et al., 2025). The mean
    runs over the stochastic entries only: deterministic steps add neither to the objective,
    nor to its normalisation, nor to the diagnostics.

    Built on ``ClipPPOLoss``'s hooks: :meth:`_log_weight` (PPO's log-prob hook) gives the
    per-step log-weight ``[*B, K, 1]`` (0 at deterministic steps) from one batched network
    call; TorchRL's ``_broadcast_advantage_to_log_weight`` spreads the decision's advantage
    over the steps; ``_reduce_loss`` reduces with the stochastic-step mask (and TorchRL's
    validity masks). TorchRL's, unchanged: the critic loss and value clipping, advantage
    normalisation (``normalize_advantage``, ``advantage_norm``), ``make_value_estimator``
    (GAE at the decision level), ``max_importance_ratio`` (caps each step's ratio),
    ``separate_losses``, reductions, functional parameters and the clip buffers.
    ``forward`` is this class's own only to average the diagnostics over the stochastic
    entries and to add the dual clip, KL and self-imitation terms. Refused at construction,
    as options it cannot honour: ``delay_actor=True``, a per-head ``entropy_coeff`` mapping,
    ``samples_mc_entropy`` (the entropy is in closed form).

    Entropy: the bonus is off by default. The entropy of a stochastic step is that of its
    Gaussian, ``sum over the H' x D entries of log std + log(2 pi e) / 2``
    (:func:`flow.gaussian_entropy <torchrl_flowpolicy.flow.gaussian_entropy>`), averaged over
    the stochastic entries and reported as ``"entropy"``. With the fixed Flow-SDE schedule
    the std does not depend on the parameters, so the bonus has no gradient and exploration
    is set by the policy's ``noise_level``. With a learned noise (the policy's
    ``noise_head``, pi-RL's Flow-Noise, ReinFlow) the std is the head's: the ratio includes
    the change of std, and ``entropy_bonus=True`` with ``entropy_coeff`` is a real bonus
    whose gradient reaches the noise head only (the mean does not enter the entropy; with
    ``context_grad=True`` it also reaches the encoder through the head's context).
    ``"loss_entropy"`` is always written, so that TorchRL's scripts can sum
    ``loss["loss_entropy"]`` as with ``ClipPPOLoss``: ``-entropy_coeff * entropy`` with the bonus,
    a zero of ``loss_objective``'s shape, dtype and device without it.

    Critic-free (``critic_network=None``, e.g. group-relative PPO with
    :class:`~torchrl_flowpolicy.objectives.GroupRelativeAdvantage`): the advantage must be in
    the batch; the loss reads it, writes no ``loss_critic`` and holds only the actor's
    parameters, and its ``in_keys`` are the actor's inputs, the action, the stored log-probs,
    the advantage and the chain (no next-step entries: nothing bootstraps). What only a critic
    can serve is refused with a ``ValueError`` naming it: ``critic_coeff > 0``,
    ``clip_value``, ``loss_critic_type`` at construction; ``make_value_estimator``,
    ``value_estimator`` and ``loss_critic`` afterwards.

    Args:
        actor_network: the :class:`~torchrl_flowpolicy.FlowSDEPolicy` to train.
        critic_network: a value network writing ``"state_value"``; ``None`` (default): no
            critic (see above).

    Keyword Args:
        clip_epsilon: a float in ``(0, 1)``, or a ``(low, high)`` pair for clip-higher (e.g. ``(0.2, 0.28)``,
            SimpleVLA-RL / DAPO).
        dual_clip: ``c > 1`` enables dual-clip PPO (Ye et al., 2020): for negative advantages
            the objective is floored at ``c * A``. ``None`` (default): off.
        context_grad: let the policy gradient reach the encoder. Default ``False``: the
            context is recomputed from the stored observation under ``no_grad``.
        kl_coeff: weight of the KL to a frozen reference actor (default 0: off).
        kl_estimator: ``"analytic"`` (default): the closed-form KL between the step's two
            diagonal Gaussians (:func:`flow.gaussian_kl <torchrl_flowpolicy.flow.gaussian_kl>`):
            ``||mu - mu_ref||^2 / (2 std^2)`` when they share their std (the fixed schedule),
            ``sum log(s_ref / s) + (s^2 + (mu - mu_ref)^2) / (2 s_ref^2) - 1 / 2`` when a
            noise head gives each its own; ``"sample"``: the estimator
            ``log pi - log pi_ref`` at the stored samples, each with its own std.
        reference_actor: the frozen reference; default: a copy of ``actor_network`` taken at
            construction (when ``kl_coeff > 0``).
        bc_coeff: weight of self-imitation: flow matching on the executed chunks of the
            decisions flagged successful (key ``success``). Default 0: off.
        sigma_distribution: the noise-level distribution of the self-imitation term.
        entropy_bonus: add ``-entropy_coeff * entropy`` (default ``False``; see above).
        check_data: check the stored data the loss reads before using them (default
            ``True``): a finite advantage, finite stored log-probs and samples ``x_{k+1}``
            at the stochastic entries, no stochastic step 0, and a finite ``loss_objective``
            (an overflow). A ``ValueError`` naming the key replaces the NaN that one bad entry
            would spread to every weight through the optimiser. The checks cost one sum per
            tensor (tens of microseconds per call on a CPU; ``docs/reliability.md``).
        **kwargs: forwarded to :class:`~torchrl.objectives.ClipPPOLoss` (``critic_coeff``,
            ``loss_critic_type``, ``normalize_advantage``, ``advantage_norm``, ``clip_value``,
            ``max_importance_ratio``, ``reduction``, ``functional``, ``separate_losses``,
            ``device``, ...).

    Keys (``set_keys``): TorchRL's (``sample_log_prob`` is the per-decision log-prob) plus
    ``step_log_prob``, ``chain``, ``sde_mask`` and ``success``; the policy's key names are
    copied at construction.

    Outputs: ``loss_objective``, ``loss_critic`` (with a critic), ``loss_kl`` (``kl_coeff >
    0``), ``loss_bc`` (``bc_coeff > 0``), ``loss_entropy`` (always; zero without the bonus);
    diagnostics ``clip_fraction``, ``kl_approx``, ``ESS``, ``mean_ratio``, ``max_ratio``,
    ``explained_variance``, ``entropy``, ``kl_reference``, ``log_prob_drift`` (the largest
    ``|logp_new - logp_old|``: about 0 on freshly collected data; a rollout/learner mismatch
    alarm) and ``num_stochastic_steps``. Without any stochastic entry (``noise_level = 0``,
    an all-False mask, an empty batch) the losses are 0 and the diagnostics take the values
    of unit ratios: ``clip_fraction``, ``kl_approx``, ``kl_reference``, ``entropy`` and
    ``log_prob_drift`` 0, ``ESS``, ``mean_ratio`` and ``max_ratio`` 1.

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
        entropy_bonus: bool = False,
        check_data: bool = True,
        **kwargs: Any,
    ):
        if not isinstance(actor_network, FlowSDEPolicy):
            raise TypeError(
                f"actor_network must be a FlowSDEPolicy, got {type(actor_network).__name__}."
            )
        if kwargs.get("delay_actor", False):
            raise ValueError("delay_actor=True is not supported by DenoisingClipPPOLoss.")
        if isinstance(kwargs.get("entropy_coeff"), Mapping):
            raise ValueError(
                "entropy_coeff must be a number: a flow policy has one action head, so a "
                "per-head mapping does not apply."
            )
        if kwargs.get("samples_mc_entropy", 1) != 1:
            raise ValueError(
                "samples_mc_entropy does not apply: the Gaussian steps' entropy is in closed form."
            )
        if critic_network is None:
            _check_critic_free(kwargs)
        _check_clip_epsilon(clip_epsilon)
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}.")
        if kl_coeff < 0 or bc_coeff < 0:
            raise ValueError(f"kl_coeff and bc_coeff must be >= 0, got {kl_coeff} and {bc_coeff}.")
        if kl_estimator not in ("analytic", "sample"):
            raise ValueError(f"kl_estimator must be 'analytic' or 'sample', got {kl_estimator!r}.")
        if kl_coeff > 0 and reference_actor is None:
            reference_actor = copy.deepcopy(actor_network)
        super().__init__(
            actor_network,
            critic_network,
            clip_epsilon=clip_epsilon,
            entropy_bonus=entropy_bonus,
            **kwargs,
        )
        if reference_actor is not None:
            reference_actor = reference_actor.requires_grad_(False).eval()
        self.reference_actor = reference_actor
        self.dual_clip = dual_clip
        self.context_grad = context_grad
        self.kl_coeff = kl_coeff
        self.kl_estimator = kl_estimator
        self.bc_coeff = bc_coeff
        self.sigma_distribution = sigma_distribution
        self.check_data = check_data
        policy_keys = actor_network.tensor_keys
        self.set_keys(
            action=policy_keys.action,
            sample_log_prob=policy_keys.log_prob,
            step_log_prob=policy_keys.step_log_prob,
            chain=policy_keys.chain,
            sde_mask=policy_keys.sde_mask,
        )

    def _set_in_keys(self) -> None:
        super()._set_in_keys()
        keys = set(self._in_keys)
        if self.critic_network is None:  # the advantage is read, not estimated: no next step
            keys = set(self.actor_network.in_keys)
            keys.update(
                {
                    self.tensor_keys.action,
                    self.tensor_keys.sample_log_prob,
                    self.tensor_keys.advantage,
                }
            )
        keys.update({self.tensor_keys.chain, self.tensor_keys.sde_mask})
        keys.add(self.tensor_keys.step_log_prob)
        if getattr(self, "bc_coeff", 0.0) > 0:
            keys.add(self.tensor_keys.success)
        self._in_keys = list(keys)

    @property
    def out_keys(self) -> list[NestedKey]:
        if self._out_keys is None:
            keys = ["loss_objective"]
            if self._has_critic:
                keys.append("loss_critic")
            if self.kl_coeff > 0:
                keys.append("loss_kl")
            if self.bc_coeff > 0:
                keys.append("loss_bc")
            keys.append("loss_entropy")
            keys += ["clip_fraction", "kl_approx", "ESS", "mean_ratio", "max_ratio"]
            keys += ["entropy", "log_prob_drift", "num_stochastic_steps"]
            self._out_keys = keys
        return self._out_keys

    @out_keys.setter
    def out_keys(self, values) -> None:
        self._out_keys = values

    # ------------------------------------------------------------------ critic
    def make_value_estimator(self, value_type: ValueEstimators | None = None, **hyperparams: Any):
        """TorchRL's ``make_value_estimator``; refused without a critic."""
        if self.critic_network is None:
            raise _no_critic_error("make_value_estimator")
        return super().make_value_estimator(value_type, **hyperparams)

    def loss_critic(
        self, tensordict: TensorDictBase
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """TorchRL's ``loss_critic``; refused without a critic."""
        if self.critic_network is None:
            raise _no_critic_error("loss_critic")
        return super().loss_critic(tensordict)

    # ------------------------------------------------------------------ hooks
    def _actor_parameters(self):
        if self.functional:
            return self.actor_network_params.to_module(
                self.actor_network, preserve_module_state=False
            )
        return contextlib.nullcontext()

    def _stochastic_steps(self, tensordict: TensorDictBase) -> StochasticSteps:
        with self._actor_parameters():
            return self.actor_network.stochastic_steps(
                tensordict,
                context_grad=self.context_grad,
                chain_key=self.tensor_keys.chain,
                sde_mask_key=self.tensor_keys.sde_mask,
                check_data=self.check_data,
            )

    def _old_step_log_prob(self, tensordict: TensorDictBase, steps: StochasticSteps) -> Tensor:
        """The stored log-probs of the stochastic entries, ``[M]``."""
        key = self.tensor_keys.step_log_prob
        old = tensordict.get(key, None)
        expected = (*tensordict.batch_size, self.actor_network.num_steps)
        if old is None:
            raise KeyError(
                f"the stored per-step log-probs {key!r} are missing; FlowSDEPolicy writes "
                f"them under RANDOM exploration (set_keys(step_log_prob=...) to rename)."
            )
        if tuple(old.shape) != expected:
            raise ValueError(
                f"{key!r} has shape {tuple(old.shape)}, expected {expected} (one log-prob "
                f"per denoising step)."
            )
        if old.requires_grad:
            raise RuntimeError(f"the stored log-probs {key!r} require grad; detach them.")
        entries = old.reshape(-1, old.shape[-1])[steps.decision_index, steps.step_index]
        if self.check_data and not flow.all_finite(entries):
            bad = ~torch.isfinite(entries)
            raise ValueError(
                f"the stored log-probs {key!r} are not finite at {int(bad.sum())} stochastic "
                f"(decision, step) entries, e.g. {entries[bad][0].item()} at "
                f"{FlowSDEPolicy._bad_entries(steps, bad, limit=1)}: the data were corrupted "
                f"(a ratio against them is inf or NaN, and so would be every gradient)."
            )
        return entries

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
        steps = self._stochastic_steps(tensordict)
        log_prob = flow.gaussian_log_prob(steps.sample, steps.mean, steps.std)
        entries = log_prob - self._old_step_log_prob(tensordict, steps).to(log_prob.dtype)
        shape = (*adv_shape, self.actor_network.num_steps)
        log_weight = flow.scatter_steps(steps, entries, shape).unsqueeze(-1)
        log_is_weight = None
        if self.max_importance_ratio is not None:
            log_is_weight = (self.max_importance_ratio.log() - log_weight.detach()).clamp_max(0)
        return log_weight, steps, -log_weight, log_is_weight

    def _advantage(self, tensordict: TensorDictBase) -> Tensor:
        """The decision's advantage ``[*B, 1]``, from the value estimator if missing."""
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
        expected = (*tensordict.batch_size, 1)
        if tuple(advantage.shape) != expected:
            raise ValueError(
                f"the advantage {self.tensor_keys.advantage!r} has shape "
                f"{tuple(advantage.shape)}, expected {expected}: one value per decision "
                f"(the tensordict's batch shape followed by 1)."
            )
        if self.check_data and not flow.all_finite(advantage):
            source = "the value estimator wrote it" if update_norm else "it was in the input"
            raise ValueError(
                f"the advantage {self.tensor_keys.advantage!r} is not finite for "
                f"{int((~torch.isfinite(advantage)).sum())} of {advantage.numel()} decisions "
                f"({source}): check the rewards, the value estimates and the data."
            )
        return self._maybe_normalize_advantage(advantage, tensordict, update_norm=update_norm)

    def _reduce_steps(self, values: Tensor, sde_mask: Tensor, tensordict: TensorDictBase) -> Tensor:
        """Reduce per-step ``values [*B, K]`` over the stochastic entries with ``reduction``.

        ``"none"`` gives a ``[*B, K]`` tensor, zero at the deterministic steps. TorchRL's
        validity masks (``loss_mask_key``) are honoured.
        """
        values = torch.where(sde_mask, values, torch.zeros_like(values))
        if self.reduction == "none":
            # Validity masks read from the input zero their entries and keep the shape.
            return self._reduce_loss(values, tensordict)
        return self._reduce_loss(values, tensordict, mask=sde_mask)

    # ------------------------------------------------------------------ forward
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tensordict = tensordict.clone(False)
        advantage = self._advantage(tensordict)
        log_weight, steps, kl_approx, log_is_weight = self._log_weight(
            tensordict, adv_shape=tensordict.batch_size
        )
        advantage = _broadcast_advantage_to_log_weight(advantage, log_weight)
        _check_advantage_broadcast(advantage, log_weight)
        clipped = log_weight.clamp(*self._clip_bounds)
        if log_is_weight is None:  # the surrogate is weighted by pi_theta / pi_behaviour
            behaviour, clipped_behaviour = log_weight, clipped
        else:
            behaviour, clipped_behaviour = log_weight + log_is_weight, clipped + log_is_weight
        ratio = behaviour.exp()
        gain = torch.minimum(ratio * advantage, clipped_behaviour.exp() * advantage)
        if self.dual_clip is not None:
            floor = self.dual_clip * advantage
            gain = torch.where(advantage < 0, torch.maximum(gain, floor), gain)

        sde_mask = flow.scatter_steps(
            steps, torch.ones_like(steps.step_index, dtype=torch.bool), log_weight.shape[:-1]
        )
        shape = sde_mask.shape
        loss_objective = self._reduce_steps(-gain[..., 0], sde_mask, tensordict)
        if self.check_data and not flow.all_finite(loss_objective):
            raise ValueError(
                f"loss_objective is not finite although the stored data are: a ratio or an "
                f"advantage overflows {loss_objective.dtype} (largest |advantage| "
                f"{advantage.abs().max().item():.3g}, largest log-ratio "
                f"{log_weight.max().item():.3g}). Normalise the advantage "
                f"(normalize_advantage=True), scale the rewards, or check that the data were "
                f"collected by this policy (log_prob_drift)."
            )
        out = TensorDict({"loss_objective": loss_objective})
        if self._has_critic:
            loss_critic, value_clip_fraction, explained_variance = self.loss_critic(tensordict)
            out.set("loss_critic", self._reduce_loss(loss_critic, tensordict).squeeze(-1))
            if value_clip_fraction is not None:
                out.set("value_clip_fraction", value_clip_fraction)
            if explained_variance is not None:
                out.set("explained_variance", explained_variance.squeeze(-1))
        if self.kl_coeff > 0:
            kl = self._reference_kl(tensordict, steps)
            dense_kl = flow.scatter_steps(steps, kl, shape)
            out.set("loss_kl", self.kl_coeff * self._reduce_steps(dense_kl, sde_mask, tensordict))
            out.set("kl_reference", kl.detach().mean() if kl.numel() else kl.new_zeros(()))
        if self.bc_coeff > 0:
            out.set("loss_bc", self.bc_coeff * self._self_imitation(tensordict))

        entropy = flow.gaussian_entropy(steps.std, steps.sample.shape)
        if self.entropy_bonus:
            dense_entropy = flow.scatter_steps(steps, entropy, shape)
            loss_entropy = self._reduce_steps(dense_entropy, sde_mask, tensordict)
            out.set("loss_entropy", -self.entropy_coeff * loss_entropy)
        else:  # no bonus: a zero, for the scripts that sum every loss_* entry by name
            out.set("loss_entropy", torch.zeros_like(out["loss_objective"]))
        with torch.no_grad():
            # Diagnostics over the M stochastic entries (row-major), as ClipPPOLoss reports
            # them over its samples; with none, the values of unit ratios (not a mean of
            # nothing, NaN).
            entries, behaviour_entries = log_weight[..., 0][sde_mask], behaviour[..., 0][sde_mask]
            num_entries = entries.numel()
            zero, one = entries.new_zeros(()), entries.new_ones(())
            if num_entries:
                clipped_entries = clipped[..., 0][sde_mask]
                clip_fraction = (clipped_entries != entries).to(entries.dtype).mean()
                ess = 2 * behaviour_entries.logsumexp(0) - (2 * behaviour_entries).logsumexp(0)
                ratio_entries = behaviour_entries.exp()
                diagnostics = {
                    "clip_fraction": clip_fraction,
                    "kl_approx": kl_approx[..., 0][sde_mask].mean(),
                    "ESS": ess.exp() / num_entries,
                    "mean_ratio": ratio_entries.mean(),
                    "max_ratio": ratio_entries.max(),
                    "entropy": entropy.mean(),
                    "log_prob_drift": entries.abs().max(),
                }
            else:
                diagnostics = {
                    "clip_fraction": zero,
                    "kl_approx": zero,
                    "ESS": one,
                    "mean_ratio": one,
                    "max_ratio": one,
                    "entropy": zero.to(entropy.dtype),
                    "log_prob_drift": zero,
                }
            for name, value in diagnostics.items():
                out.set(name, value)
            out.set("num_stochastic_steps", torch.tensor(num_entries))
        self._clear_weakrefs(
            tensordict,
            out,
            "actor_network_params",
            "critic_network_params",
            "target_actor_network_params",
            "target_critic_network_params",
        )
        return out

    # ------------------------------------------------------------------ extra terms
    def _reference_kl(self, tensordict: TensorDictBase, steps: StochasticSteps) -> Tensor:
        """Per-entry KL(pi || pi_ref) of the stochastic steps, ``[M]``."""
        with torch.no_grad():
            reference = self.reference_actor.stochastic_steps(
                tensordict,
                chain_key=self.tensor_keys.chain,
                sde_mask_key=self.tensor_keys.sde_mask,
            )
        reference_mean = reference.mean.to(steps.mean.dtype)
        reference_std = reference.std.to(steps.mean.dtype)
        if self.kl_estimator == "analytic":
            return flow.gaussian_kl(steps.mean, steps.std, reference_mean, reference_std)
        log_prob = flow.gaussian_log_prob(steps.sample, steps.mean, steps.std)
        return log_prob - flow.gaussian_log_prob(steps.sample, reference_mean, reference_std)

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
        if self.reduction == "none":  # one value per decision, zero where not successful
            return error.new_zeros(success.shape).masked_scatter(success, error)
        if error.numel() == 0:
            return error.new_zeros(())
        return error.mean() if self.reduction == "mean" else error.sum()
