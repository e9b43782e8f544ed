"""The learner of ``examples/ppo.py``: critic, ``DenoisingClipPPOLoss`` and optimisers
(:func:`make_learner`), the minibatch replay buffer, the learning-rate decay and the run
checkpoint that ``--resume`` reads; the script's plumbing, kept out of its top-to-bottom
read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.objectives import ValueEstimators

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.envs import decision_discount
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.training import models, runs

# ----------------------------------------------------------------------------- policy, critic, loss


@dataclass
class Learner:
    """What PPO trains, and what a run checkpoint holds (:meth:`trained`); no critic (``None``)
    with ``--advantage grpo``."""

    policy: FlowSDEPolicy
    critic: TensorDictModule | None
    loss_module: DenoisingClipPPOLoss
    actor_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None

    def set_actor_rates(self, env_steps: int, config: Any) -> None:
        """The actor's learning rates for the batch collected after ``env_steps``: the
        options' rates (not a resumed optimiser's) times
        :func:`~torchrl_flowpolicy.training.runs.learning_rate_factor`."""
        factor = runs.learning_rate_factor(
            env_steps, config.total_env_steps, config.actor_learning_rate_decay_env_steps
        )
        rates = [config.actor_learning_rate, config.noise_learning_rate]
        for group, rate in zip(self.actor_optimizer.param_groups, rates, strict=False):
            group["lr"] = rate * factor

    def trained(self) -> dict[str, Any]:
        names = ("policy", "critic", "actor_optimizer", "critic_optimizer")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def make_learner(policy: FlowSDEPolicy, config: Any, executed_chunk_length: int) -> Learner:
    """Critic, ``DenoisingClipPPOLoss`` with GAE over decisions, one Adam for each network (a
    learned noise head gets its own learning rate). ``--advantage grpo``: no critic; the
    loss reads the group-relative advantage unnormalised (it is normalised per group)."""
    parameters: Any = policy.parameters()
    if policy.noise_head is not None:
        head = list(policy.noise_head.parameters())
        flow = [p for p in policy.parameters() if all(p is not h for h in head)]
        parameters = [{"params": flow}, {"params": head, "lr": config.noise_learning_rate}]
    actor_optimizer = torch.optim.Adam(parameters, lr=config.actor_learning_rate)
    actor_options = {
        "clip_epsilon": (config.clip_epsilon_low, config.clip_epsilon_high),
        "context_grad": config.context_grad,
        "kl_coeff": config.kl_coeff,
        "bc_coeff": config.bc_coeff,
        "entropy_bonus": config.entropy_coeff > 0,
        "entropy_coeff": config.entropy_coeff,
    }
    if config.advantage == "grpo":
        loss_module = DenoisingClipPPOLoss(policy, **actor_options, normalize_advantage=False)
        return Learner(policy, None, loss_module, actor_optimizer, None)
    critic = models.build_value_network(policy)
    loss_module = DenoisingClipPPOLoss(
        policy, critic, **actor_options, normalize_advantage=True, loss_critic_type="l2"
    )
    gamma = decision_discount(config.gamma, executed_chunk_length)
    loss_module.make_value_estimator(ValueEstimators.GAE, gamma=gamma, lmbda=config.gae_lambda)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=config.critic_learning_rate)
    return Learner(policy, critic, loss_module, actor_optimizer, critic_optimizer)


def make_replay_buffer(
    config: Any, decisions_per_batch: int, device: torch.device | str = "cpu"
) -> ReplayBuffer:
    """One batch of decisions on ``device``, served in ``minibatch_size`` minibatches without
    replacement (one epoch per pass)."""
    storage = LazyTensorStorage(decisions_per_batch, device=device)
    sampler = SamplerWithoutReplacement()
    return ReplayBuffer(storage=storage, sampler=sampler, batch_size=config.minibatch_size)


# ----------------------------------------------------------------------------- checkpoints
def save_ppo_run(
    path: Path,
    learner: Learner,
    model_config: models.ModelConfig,
    config: Any,
    run: runs.RunProgress,
    start: dict[str, Any] | None = None,
) -> None:
    """The run checkpoint ``--resume`` reads (what the learner trains, the progress, the
    advantage and ``start``: the seed and the pretrained weights' digest), from which
    ``load_policy`` also rebuilds the fine-tuned policy
    (:func:`~torchrl_flowpolicy.training.models.save_policy_run`, which records the sampler settings
    and the noise)."""
    progress = {"task": config.task, "advantage": config.advantage, **(start or {})}
    progress |= run.state()
    models.save_policy_run(path, learner.trained(), learner.policy, model_config, **progress)
