"""PPO fine-tuning of a pretrained flow policy: the library's main job (Pusher-v5; robosuite
Lift and PickPlaceCan with ``--task lift`` / ``--task can``).

Reads top to bottom, CleanRL's order: config -> the pretrained policy (behaviour cloning by
``examples/pretrain.py``, run first when its checkpoint is missing) and the evaluation
baselines -> critic, ``DenoisingClipPPOLoss``, optimisers -> the collector -> the loop (one
:func:`ppo_iteration` per batch: GAE or group-relative advantages, then minibatch epochs;
deterministic evaluation at K = 20 on the learning-curve seeds, logging, checkpoints) -> the
held-out protocol (BC and PPO under both decodings, the clean expert, 95 % intervals;
``torchrl_flowpolicy.protocol``) -> learning-curve PNG, JSON summary, run checkpoint.

The plumbing lives in the package: the collector backends and their seeding
(``torchrl_flowpolicy.collectors``: one process, ``--collector_workers N`` processes, Ray with
``--collector_backend ray``), the run checkpoint and resume (``torchrl_flowpolicy.runs``), the
policy's checkpoint (``torchrl_flowpolicy.models``), the logger and the reports.

Modes: ``--advantage grpo`` drops the critic (group-relative PPO as Flow-GRPO and pi-RL
fine-tune flow policies: groups of ``group_size`` environments start every batch from one
state, each episode's return is scored against its group's; docs/grpo.md). ``--noise
learned`` adds a fresh noise head that predicts the std of every stochastic step (pi-RL's
Flow-Noise, ReinFlow; docs/learned_noise.md). Under ``torchrun --nproc_per_node N`` the
learner is data-parallel (``torchrl_flowpolicy.distributed``): rank ``r`` seeds torch with
``seed + r`` and collects ``num_envs`` environments of its own, every rank starts from rank
0's weights and gradients are averaged before clipping; rank 0 alone pretrains, evaluates,
logs and saves (docs/scaling.md). ``--device cuda`` puts the policy, critic, loss, batches
and replay buffer on the GPU; the simulators stay on the CPU.

Exact resume: every batch starts from fresh resets seeded from the run seed and the
iteration, and a checkpoint holds every random generator's state besides the weights and
optimisers, so a run killed at any moment and resumed with ``--resume`` logs the numbers of
the uninterrupted run, bit for bit, on the same machine with one collector process
(``tests/test_main_job.py``). With collector workers, Ray or ``torchrun`` a resumed run
starts each batch from the same states but its sampling noise comes from streams the
checkpoint does not hold. ``--quick`` runs the whole chain in about a minute.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.objectives import ValueEstimators
from tqdm import tqdm

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.collectors import (
    CollectorOptions,
    TaskEnvFactory,
    env_steps,
    first_reset_seed,
    make_collector,
    seed_batch,
    shutdown_collector,
)
from torchrl_flowpolicy.distributed import (
    average_gradients,
    barrier,
    broadcast_parameters,
    close_distributed,
    init_distributed,
    sum_over_processes,
)
from torchrl_flowpolicy.envs import decision_discount, get_task
from torchrl_flowpolicy.evaluation import evaluate_policy
from torchrl_flowpolicy.loggers import MetricLogger
from torchrl_flowpolicy.models import (
    ModelConfig,
    build_noise_head,
    load_policy_checkpoint,
    policy_record,
)
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss, GroupRelativeAdvantage
from torchrl_flowpolicy.protocol import CURVE_SEED
from torchrl_flowpolicy.reports import (
    curve_baselines,
    decisions_per_episode,
    held_out_protocol,
    make_eval_env,
    plot_learning_curve,
    run_summary,
    task_options,
)
from torchrl_flowpolicy.runs import (
    load_run,
    require_run_checkpoint,
    resolve_device,
    restore_random_state,
    resume_run,
    save_run,
    seed_random_generators,
    write_json,
)
from torchrl_flowpolicy.sampler import SamplerOptions

import pretrain
from common import TaskOptions, option, parse_config, task_defaults, validate_config

# The options that configure the noise head: refused with --noise fixed, where nothing reads them.
LEARNED_NOISE_OPTIONS = (
    "min_noise_std",
    "max_noise_std",
    "initial_noise_std",
    "noise_learning_rate",
)


@dataclass
class PPOConfig(TaskOptions):
    """PPO fine-tuning settings; every field is a command-line option."""

    seed: int = option(
        0, "seeds torch, the environments and the pretraining when it runs", minimum=0
    )
    output_dir: str = option("outputs/ppo", "checkpoints, logs, plot and summary")
    pretrained_checkpoint: str = option(
        "outputs/pretrain/policy.pt", "the behaviour-cloned policy (pretrained here if missing)"
    )
    num_envs: int = option(
        16, "training environments (split evenly over the collector workers)", minimum=1
    )
    collector_workers: int = option(
        1,
        "collector processes (> 1: TorchRL's MultiSyncCollector, weights synced per update)",
        minimum=1,
    )
    collector_backend: Literal["process", "ray"] = option(
        "process",
        "process: collection in this process (1 worker) or in worker processes; ray: "
        "TorchRL's RayCollector, one Ray actor per worker (needs the ray extra)",
    )
    ray_address: str = option(
        "",
        "collector_backend=ray: the Ray cluster (empty: RAY_ADDRESS or the cluster started "
        "on this machine by `ray start`, else a new local Ray instance; auto: an existing one)",
    )
    device: str = option(
        "cpu", "torch device of the policy, critic, loss, batches and replay buffer (cpu, cuda)"
    )
    episodes_per_batch: int = option(1, "episodes per environment per PPO iteration", minimum=1)
    total_env_steps: int = option(1_200_000, "environment steps of fine-tuning", minimum=1)
    # Flow-SDE sampler (rollouts) and the evaluation ODE.
    noise_level: float = option(0.5, "a: exploration noise of the Flow-SDE step", minimum=0)
    rollout_noise_scale: float = option(
        1.0,
        "std of the rollouts' x_0 (0: chains start at x_0 = 0, exploration from the stochastic "
        "steps alone); the learning curve decodes with the same x_0 std",
        minimum=0,
    )
    num_steps: int = option(8, "K: denoising steps of rollouts and of the learner", minimum=1)
    eval_num_steps: int = option(20, "K of the deterministic evaluation ODE", minimum=1)
    sde_mode: Literal["mixed", "last", "all"] = option(
        "last", "stochastic steps: one random step (mixed), the last num_sde_steps, all"
    )
    num_sde_steps: int = option(4, "stochastic steps for sde_mode=last", minimum=0)
    noise: Literal["fixed", "learned"] = option(
        "fixed",
        "noise of the stochastic steps: fixed (Flow-SDE, g = a sqrt(sigma / (1 - sigma))) or "
        "learned (a fresh noise head's std on the Euler ODE mean: Flow-Noise, ReinFlow)",
    )
    min_noise_std: float = option(0.02, "noise=learned: lower bound of the step std", above=0)
    max_noise_std: float = option(0.3, "noise=learned: upper bound of the step std", above=0)
    initial_noise_std: float = option(
        0.08, "noise=learned: the fresh head's std, everywhere (inside the bounds)", above=0
    )
    noise_learning_rate: float = option(3e-4, "noise=learned: Adam on the noise head", above=0)
    entropy_coeff: float = option(
        0.0, "entropy bonus (0: off; it has a gradient with noise=learned only)", minimum=0
    )
    # PPO.
    advantage: Literal["gae", "grpo"] = option(
        "gae",
        "gae: a value network and GAE over decisions; grpo: no critic, each episode's return "
        "against those of its group (docs/grpo.md)",
    )
    group_size: int = option(
        4,
        "advantage=grpo: environments per group, reset from one initial state at every batch "
        "(num_envs must be a multiple)",
        minimum=2,
    )
    epochs: int = option(4, "passes over each batch", minimum=1)
    minibatch_size: int = option(304, "decisions per minibatch", minimum=1)
    actor_learning_rate: float = option(3e-5, "Adam on the flow policy", above=0)
    critic_learning_rate: float = option(1e-3, "Adam on the value network", above=0)
    clip_epsilon_low: float = option(0.2, "ratio clip below 1", above=0, maximum=1)
    clip_epsilon_high: float = option(0.28, "ratio clip above 1 (clip-higher)", above=0)
    kl_coeff: float = option(0.0, "KL to the pretrained policy (0: off)", minimum=0)
    bc_coeff: float = option(
        0.1, "self-imitation: flow matching on successful episodes (0: off)", minimum=0
    )
    gamma: float = option(
        0.99,
        "discount per env step; per decision: gamma ** executed rows (gae; grpo: returns are "
        "undiscounted)",
        minimum=0,
        maximum=1,
    )
    gae_lambda: float = option(0.95, "GAE lambda over decisions", minimum=0, maximum=1)
    reward_scale: float = option(0.1, "multiplies the summed chunk reward", above=0)
    max_grad_norm: float = option(1.0, "gradient clipping", above=0)
    critic_warmup_iterations: int = option(
        3, "first iterations train only the critic (grpo: no critic, ignored)", minimum=0
    )
    # Evaluation, logging, checkpoints.
    eval_every: int = option(20, "iterations between deterministic evaluations", minimum=1)
    eval_episodes: int = option(
        50, "learning-curve episodes (curve seeds 10000+, as BC's)", minimum=1
    )
    held_out_episodes: int = option(
        200, "final protocol episodes (held-out seeds 30000+: used by nothing else)", minimum=1
    )
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "noise_free",
        "PPO's decoding reported on the held-out states (chosen on validation states, "
        "before looking at held-out numbers)",
    )
    checkpoint_every: int = option(20, "iterations between checkpoints", minimum=1)
    loggers: str = option("wandb,csv", "TorchRL loggers, comma-separated (wandb runs offline)")
    resume: bool = option(False, "continue from output_dir/checkpoint.pt")
    threads: int = option(
        2,
        "torch CPU threads (2 on 2 cores: updates 1.8x faster than 1; rollouts the same)",
        minimum=1,
    )
    pretrain: pretrain.PretrainConfig = option(
        default_factory=pretrain.PretrainConfig,
        help="behaviour cloning, run when pretrained_checkpoint is missing (with this run's "
        "seed and task settings; it writes pretrained_checkpoint)",
    )

    def option_conflicts(self) -> list[str]:
        """Options that contradict each other: checked with the bounds (exit 2 on the command
        line; ``ValueError`` in ``main``)."""
        conflicts = []
        if self.noise == "fixed":
            defaults = {field.name: field.default for field in dataclasses.fields(self)}
            changed = [
                name for name in LEARNED_NOISE_OPTIONS if getattr(self, name) != defaults[name]
            ]
            if changed:
                given = " ".join(f"--{name} {getattr(self, name)}" for name in changed)
                conflicts.append(
                    f"{given}: only with --noise learned (the fixed Flow-SDE schedule's std is "
                    f"set by --noise_level and the grid)"
                )
            if self.entropy_coeff > 0:
                conflicts.append(
                    f"--entropy_coeff {self.entropy_coeff}: needs --noise learned (the fixed "
                    f"schedule's entropy does not depend on the parameters: no gradient)"
                )
        if self.advantage != "grpo":
            return conflicts
        if self.num_envs % self.group_size:
            conflicts.append(
                f"--num_envs {self.num_envs}: must be a multiple of --group_size "
                f"{self.group_size} with --advantage grpo (groups of group_size environments "
                f"start from one initial state)"
            )
        if self.episodes_per_batch != 1:
            conflicts.append(
                f"--episodes_per_batch {self.episodes_per_batch}: must be 1 with --advantage grpo "
                f"(a batch holds one episode per environment; more groups: --num_envs)"
            )
        if self.collector_workers != 1 or self.collector_backend != "process":
            conflicts.append(
                f"--collector_workers {self.collector_workers} --collector_backend "
                f"{self.collector_backend}: must be 1 and process with --advantage grpo (the "
                f"groups are reseeded from this process before every batch)"
            )
        return conflicts


# What --quick changes: the whole chain in about a minute.
QUICK = {
    "num_envs": 4,
    "total_env_steps": 4 * 150 * 4,
    "epochs": 2,
    "minibatch_size": 76,
    "eval_every": 2,
    "checkpoint_every": 2,
    "eval_episodes": 8,
    "held_out_episodes": 8,
    "critic_warmup_iterations": 1,
    "group_size": 2,
    "pretrain.train_steps": 150,
    "pretrain.eval_episodes": 8,
    "threads": 1,
}


# What --task lift / can change (robosuite Lift and PickPlaceCan, see
# torchrl_flowpolicy.envs.robosuite_tasks); the pretraining's own task defaults come along.
RUN_DEFAULTS: dict[str, dict[str, Any]] = {
    "lift": {
        **{f"pretrain.{name}": value for name, value in pretrain.DEMO_DEFAULTS["lift"].items()},
        # The recipe of docs/robosuite.md (from 25 demonstrations to 93.5-98 % noise-free
        # on the held-out states in 600k env steps): 48 envs x 15 decisions = 720 decisions
        # a batch, two minibatches; strong self-imitation and a larger actor step than
        # Pusher's; the sparse success reward (1 at success) is used as is.
        "num_envs": 48,
        "minibatch_size": 360,
        "bc_coeff": 1.0,
        "actor_learning_rate": 1e-4,
        "reward_scale": 1.0,
        "total_env_steps": 600_000,
        "eval_every": 10,
        "checkpoint_every": 10,
    },
    # --task can (robosuite PickPlaceCan): 16 envs x 63 decisions = 1,008 decisions a batch.
    "can": {
        **{f"pretrain.{name}": value for name, value in pretrain.DEMO_DEFAULTS["can"].items()},
        "minibatch_size": 504,
        "reward_scale": 1.0,
        "total_env_steps": 500_000,
        "eval_every": 5,
        "checkpoint_every": 5,
    },
}


def parse_args(argv: list[str] | None = None) -> PPOConfig:
    """The command line (``--help``) as a :class:`PPOConfig`."""
    exclude = [f"pretrain.{name}" for name in pretrain.RUN_SETTINGS] + [
        f"pretrain.{name}" for name in pretrain.EXCLUDE
    ]
    return parse_config(
        PPOConfig,
        argv,
        description=__doc__,
        quick=QUICK,
        task_defaults=task_defaults(RUN_DEFAULTS),
        exclude=exclude,
    )


def sampler_options(config: PPOConfig) -> SamplerOptions:
    """The flow policy's sampler settings (rollouts, learner, evaluation), in one place.

    The evaluation's initial noise has the rollouts' scale: the learning curve decodes with
    the ``x_0`` std the policy was trained with (``--rollout_noise_scale``).
    """
    return SamplerOptions(
        num_denoising_steps=config.num_steps,
        eval_num_denoising_steps=config.eval_num_steps,
        noise_level=config.noise_level,
        rollout_noise_scale=config.rollout_noise_scale,
        eval_noise_scale=config.rollout_noise_scale,
        sde_mode=config.sde_mode,
        num_sde_steps=config.num_sde_steps,
    )


def check_config(config: PPOConfig, world_size: int) -> torch.device:
    """Refuse, before any work, what the run could not do; returns the run's device.

    Raises:
        ValueError: a number outside its option's bounds, or options that contradict each
            other (:meth:`PPOConfig.option_conflicts`); learned-noise bounds that do not
            nest; an unavailable ``--device``; ``num_envs`` not a multiple of
            ``collector_workers``; the Ray backend under ``torchrun``.
        ImportError: ``--collector_backend ray`` without ``ray`` installed.
        FileNotFoundError: ``--resume`` without a checkpoint in ``output_dir``.
    """
    validate_config(config)
    low, initial, high = config.min_noise_std, config.initial_noise_std, config.max_noise_std
    if config.noise == "learned" and not low < initial < high:
        raise ValueError(
            f"--noise learned needs --min_noise_std < --initial_noise_std < --max_noise_std, "
            f"got {low} < {initial} < {high}: the std is squashed into [min, max] and starts "
            f"strictly inside."
        )
    device = resolve_device(config.device)
    if config.num_envs % config.collector_workers:
        raise ValueError(
            f"--num_envs {config.num_envs} must be a positive multiple of --collector_workers "
            f"{config.collector_workers} (each worker steps num_envs / collector_workers "
            f"environments)."
        )
    if config.collector_backend == "ray" and world_size > 1:
        raise ValueError(
            "--collector_backend ray under torchrun is not supported (one RayCollector per "
            "learner rank is untested): use one learner process with Ray workers, or torchrun "
            "with --collector_backend process."
        )
    if config.collector_backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ImportError(
            "--collector_backend ray needs Ray: pip install 'torchrl_flowpolicy[ray]' (or use "
            "--collector_backend process)."
        )
    if config.resume:
        require_run_checkpoint(Path(config.output_dir) / "checkpoint.pt")
    return device


# ----------------------------------------------------------------------------- env
def collection(
    config: PPOConfig,
    executed_chunk_length: int,
    frames_per_batch: int,
    device: torch.device | str = "cpu",
) -> tuple[TaskEnvFactory, CollectorOptions]:
    """The training environments (chunked, counting env steps; with ``--advantage grpo``
    seeded in groups of ``group_size``) and how they are collected
    (:func:`~torchrl_flowpolicy.collectors.make_collector`)."""
    group_size = config.group_size if config.advantage == "grpo" else 1
    make_env = TaskEnvFactory(config.task, executed_chunk_length, task_options(config), group_size)
    options = CollectorOptions(
        num_envs=config.num_envs,
        frames_per_batch=frames_per_batch,
        workers=config.collector_workers,
        backend=config.collector_backend,
        worker_threads=config.threads,
        ray_address=config.ray_address,
        device=device,
    )
    return make_env, options


# ----------------------------------------------------------------------------- policy, critic, loss
def add_noise_head(policy: FlowSDEPolicy, config: PPOConfig, model_config: ModelConfig) -> None:
    """``--noise learned``: a fresh noise head for RL (the pretrained policy has none)."""
    if config.noise == "learned":
        head = build_noise_head(
            model_config, config.min_noise_std, config.max_noise_std, config.initial_noise_std
        )
        policy.noise_head = head.to(policy.encoder[0].loc.device)


def make_critic(policy: FlowSDEPolicy) -> TensorDictModule:
    """Value network on the observation, normalised with the policy's statistics, on the
    policy's device."""
    normalizer = copy.deepcopy(policy.encoder[0])
    network = nn.Sequential(
        normalizer,
        nn.Linear(normalizer.loc.numel(), 256),
        nn.Tanh(),
        nn.Linear(256, 256),
        nn.Tanh(),
        nn.Linear(256, 1),
    )
    critic = TensorDictModule(network, in_keys=["observation"], out_keys=["state_value"])
    return critic.to(normalizer.loc.device)


@dataclass
class Learner:
    """What PPO trains, and what a run checkpoint holds (:meth:`trained`); no critic (``None``)
    with ``--advantage grpo``."""

    policy: FlowSDEPolicy
    critic: TensorDictModule | None
    loss_module: DenoisingClipPPOLoss
    actor_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None

    def trained(self) -> dict[str, Any]:
        trained = {
            "policy": self.policy,
            "critic": self.critic,
            "actor_optimizer": self.actor_optimizer,
            "critic_optimizer": self.critic_optimizer,
        }
        return {name: item for name, item in trained.items() if item is not None}


def make_learner(policy: FlowSDEPolicy, config: PPOConfig, executed_chunk_length: int) -> Learner:
    """Critic, ``DenoisingClipPPOLoss`` with GAE over decisions, one Adam for each network
    (a learned noise head gets its own learning rate).

    ``--advantage grpo``: no critic; the loss reads the group-relative advantage that
    :func:`group_relative_batch` writes, unnormalised (it is normalised per group already).
    """
    actor_parameters: Any = policy.parameters()
    if policy.noise_head is not None:
        head = list(policy.noise_head.parameters())
        flow_parameters = [p for p in policy.parameters() if all(p is not h for h in head)]
        actor_parameters = [
            {"params": flow_parameters},
            {"params": head, "lr": config.noise_learning_rate},
        ]
    actor_optimizer = torch.optim.Adam(actor_parameters, lr=config.actor_learning_rate)
    actor_options = {
        "clip_epsilon": (config.clip_epsilon_low, config.clip_epsilon_high),
        "kl_coeff": config.kl_coeff,
        "bc_coeff": config.bc_coeff,
        "entropy_bonus": config.entropy_coeff > 0,
        "entropy_coeff": config.entropy_coeff,
    }
    if config.advantage == "grpo":
        loss_module = DenoisingClipPPOLoss(policy, **actor_options, normalize_advantage=False)
        return Learner(policy, None, loss_module, actor_optimizer, None)
    critic = make_critic(policy)
    loss_module = DenoisingClipPPOLoss(
        policy, critic, **actor_options, normalize_advantage=True, loss_critic_type="l2"
    )
    loss_module.make_value_estimator(
        ValueEstimators.GAE,
        gamma=decision_discount(config.gamma, executed_chunk_length),
        lmbda=config.gae_lambda,
    )
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=config.critic_learning_rate)
    return Learner(policy, critic, loss_module, actor_optimizer, critic_optimizer)


def make_replay_buffer(
    config: PPOConfig, decisions_per_batch: int, device: torch.device | str = "cpu"
) -> ReplayBuffer:
    """One batch of decisions on ``device``, served in ``minibatch_size`` minibatches without
    replacement (one epoch per pass)."""
    return ReplayBuffer(
        storage=LazyTensorStorage(decisions_per_batch, device=device),
        sampler=SamplerWithoutReplacement(),
        batch_size=config.minibatch_size,
    )


# ----------------------------------------------------------------------------- the update
def episode_success_flags(batch: TensorDictBase) -> torch.Tensor:
    """Flag every decision of an episode that ended in success, ``[num_envs, T]`` (episodes
    that have not ended within the batch are not flagged)."""
    done = batch["next", "done"].squeeze(-1)
    success = batch["next", "success"].squeeze(-1) & done
    flags = torch.zeros_like(done)
    carry = torch.zeros_like(done[:, 0])
    for step in reversed(range(done.shape[1])):
        carry = torch.where(done[:, step], success[:, step], carry)
        flags[:, step] = carry
    return flags


def group_relative_batch(batch: TensorDictBase, config: PPOConfig) -> TensorDictBase:
    """``--advantage grpo``: the decisions of each environment's first episode, ``[M]``, with
    its group-relative advantage.

    Environment ``i`` of the ``[num_envs, T]`` batch belongs to group ``i // group_size``
    (``"group_id"``); :class:`GroupRelativeAdvantage` scores the return of its first episode
    (every environment started one at the batch's reset, and ``T`` covers a whole episode)
    against its group's; the decisions after an early end (the next episode) are dropped.
    """
    environment = torch.arange(batch.shape[0], device=batch.device)
    batch["group_id"] = (environment // config.group_size).unsqueeze(-1).expand(batch.shape)
    batch = GroupRelativeAdvantage()(batch)
    return batch[batch["episode_mask"]]


def group_statistics(
    episodes: TensorDictBase, config: PPOConfig, collected_decisions: int
) -> dict[str, float]:
    """``--advantage grpo`` diagnostics of a :func:`group_relative_batch` (whose episodes end
    in the order of their environments)."""
    done = episodes["next", "done"].squeeze(-1)
    returns = episodes["episode_return"][done].reshape(-1, config.group_size)
    no_spread = returns.amax(-1) == returns.amin(-1)
    return {
        "grpo/episode_return": returns.mean().item(),
        "grpo/group_return_std": returns.std(-1).mean().item(),
        "grpo/zero_std_groups": no_spread.float().mean().item(),
        "grpo/kept_decisions": episodes.numel() / collected_decisions,
    }


def ppo_iteration(
    learner: Learner,
    batch: TensorDictBase,
    replay_buffer: ReplayBuffer,
    config: PPOConfig,
    train_actor: bool,
) -> dict[str, float]:
    """Scale rewards, flag successes, GAE, then ``epochs`` passes of minibatch updates.

    The critic is always trained, the actor only with ``train_actor``; under ``torchrun``
    the gradients are averaged over the ranks before clipping. ``--advantage grpo``: the
    group-relative advantage of each environment's first episode
    (:func:`group_relative_batch`) instead of GAE, and the actor alone is trained. Returns
    the loss entries averaged over the minibatches and the batch's training statistics.
    """
    policy, critic, loss_module = learner.policy, learner.critic, learner.loss_module
    batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
    if config.bc_coeff > 0:
        batch["success"] = episode_success_flags(batch)
    collected_decisions = batch.numel()
    if critic is None:  # grpo
        batch = group_relative_batch(batch, config)
    else:
        with torch.no_grad():
            loss_module.value_estimator(batch)
    replay_buffer.empty()
    replay_buffer.extend(batch.reshape(-1))
    trained = (
        [*policy.parameters()] if critic is None else [*critic.parameters(), *policy.parameters()]
    )
    optimizers = (
        [learner.actor_optimizer]
        if critic is None
        else [learner.critic_optimizer, learner.actor_optimizer]
    )
    metrics: dict[str, list[float]] = {}
    fresh_drift = None
    for _ in range(config.epochs):
        for minibatch in replay_buffer:
            losses = loss_module(minibatch)
            if fresh_drift is None:  # before any update: the rollout/learner mismatch alarm
                fresh_drift = losses["log_prob_drift"].item()
            actor_loss = losses["loss_objective"]
            for name in ("loss_kl", "loss_bc"):
                if name in losses.keys():
                    actor_loss = actor_loss + losses[name]
            if config.entropy_coeff > 0:
                actor_loss = actor_loss + losses["loss_entropy"]
            if critic is not None:  # gae: the critic always, the actor after the warm-up
                actor_loss = losses["loss_critic"] + (actor_loss if train_actor else 0.0)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            average_gradients(trained)  # over the ranks
            if critic is not None:
                torch.nn.utils.clip_grad_norm_(critic.parameters(), config.max_grad_norm)
                learner.critic_optimizer.step()
            if critic is None or train_actor:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                learner.actor_optimizer.step()
            for name, value in losses.items():
                metrics.setdefault(name, []).append(float(value.detach()))

    done = batch["next", "done"].squeeze(-1)
    train_success = batch["next", "success"].squeeze(-1)[done].float()
    row = {name: sum(values) / len(values) for name, values in metrics.items()}
    row["train/episode_success"] = train_success.mean().item() if done.any() else 0.0
    row["train/chunk_reward"] = batch["next", "reward"].mean().item()
    row["log_prob_drift_before_update"] = fresh_drift
    if critic is None:
        row.update(group_statistics(batch, config, collected_decisions))
    if ("flow", "step_std") in batch.keys(True):  # the rollouts' learned std
        row["train/noise_std"] = batch["flow", "step_std"][batch["flow", "sde_mask"]].mean().item()
    return row


# ----------------------------------------------------------------------------- checkpoints
# What a run checkpoint saved before an entry of run_identity was recorded implies: every run
# had a critic before GRPO and the fixed Flow-SDE noise before the noise head.
IMPLIED_IDENTITY = {"advantage": "gae", "noise": {"kind": "fixed"}}


def run_identity(config: PPOConfig, model_config: ModelConfig) -> dict[str, Any]:
    """What a resumed checkpoint must share with this run: the task, the architecture
    (chunking included) of the pretrained policy, the advantage (a critic or none) and the
    kind of exploration noise (with the learned std's bounds)."""
    noise = {"kind": "fixed"}
    if config.noise == "learned":
        noise = {
            "kind": "learned",
            "min_std": config.min_noise_std,
            "max_std": config.max_noise_std,
        }
    return {
        "task": config.task,
        "model_config": dataclasses.asdict(model_config),
        "advantage": config.advantage,
        "noise": noise,
    }


def save_ppo_run(
    path: Path,
    learner: Learner,
    model_config: ModelConfig,
    config: PPOConfig,
    progress: dict[str, Any],
) -> None:
    """The run checkpoint ``--resume`` reads: what the learner trains, ``progress``
    (``iteration``, ``env_steps``, ``history``, ``wall_seconds``: where a resumed run's
    clock goes on from), the advantage, and the policy's record
    (:func:`~torchrl_flowpolicy.models.policy_record`: architecture, task, sampler settings
    and noise, so that ``load_policy`` rebuilds the fine-tuned policy, noise head included).
    With ``--advantage grpo`` it holds no critic."""
    save_run(
        path,
        learner.trained(),
        **{**progress, "history": json.dumps(progress["history"])},
        advantage=config.advantage,
        **policy_record(learner.policy, model_config, config.task),
    )


def resume_progress(saved: dict[str, Any] | None, learner: Learner) -> dict[str, Any]:
    """The counters, history and wall time to start from: a fresh run's, or (``--resume``)
    those of the checkpoint, whose networks and optimisers are loaded into ``learner``."""
    progress = {"iteration": 0, "env_steps": 0, "history": [], "wall_seconds": 0.0}
    if saved is None:
        return progress
    saved = resume_run(saved, learner.trained())
    history = json.loads(saved["history"])
    # Older checkpoints hold no wall time: that of the last curve row.
    elapsed = saved.get("wall_seconds", history[-1]["wall_seconds"] if history else 0.0)
    print(f"resumed from iteration {saved['iteration']} ({saved['env_steps']} env steps)")
    return {
        **progress,
        **{name: saved[name] for name in ("iteration", "env_steps")},
        "history": history,
        "wall_seconds": elapsed,
        "random_state": saved["random_state"],
    }


# ----------------------------------------------------------------------------- main
def main(config: PPOConfig) -> dict:
    # Config: the process's rank, its device and seeds, the output folder.
    rank, world_size = init_distributed()  # (0, 1) unless launched by torchrun
    device = check_config(config, world_size)  # unavailable device, bad split: fail now
    main_process = rank == 0
    seed_random_generators(config.seed + rank)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # Policy: the pretrained one (behaviour cloning, made first when missing, by rank 0),
    # kept as BC for the protocol; --resume's checkpoint refused now if of another run.
    pretrained = Path(config.pretrained_checkpoint)
    if main_process and not pretrained.is_file():
        pretrain.main(pretrain.config_for_run(config))
    barrier()
    policy, model_config, _, pretrained_state = load_policy_checkpoint(
        pretrained, sampler=sampler_options(config), task=config.task
    )
    policy.to(device)
    run_checkpoint = output_dir / "checkpoint.pt"
    identity = run_identity(config, model_config)
    saved = load_run(run_checkpoint, identity, IMPLIED_IDENTITY) if config.resume else None
    bc_policy = copy.deepcopy(policy)
    add_noise_head(policy, config, model_config)
    executed = model_config.executed_chunk_length
    max_decisions = decisions_per_episode(config.max_episode_steps, executed)

    # Evaluation env (curve seeds) and the baselines: BC under both decodings, the expert.
    evaluate = functools.partial(
        evaluate_policy, max_decisions=max_decisions, seed=CURVE_SEED,
        num_episodes=config.eval_episodes,
    )  # fmt: skip
    if main_process:
        eval_env = make_eval_env(config, config.eval_episodes, executed, device)
        baselines = curve_baselines(policy, eval_env, max_decisions, config)

    # Critic, loss, optimisers; resumed with the counters and history if asked; every rank
    # starts from rank 0's weights.
    learner = make_learner(policy, config, executed)
    progress = resume_progress(saved, learner)
    start -= progress["wall_seconds"]  # a resumed run's clock goes on
    for network in (learner.policy, learner.critic):
        if network is not None:
            broadcast_parameters(network)

    # Collector: a batch is episodes_per_batch full-length episodes' decisions per env, from
    # fresh resets seeded per iteration; the minibatch sampler; the logger (a resumed run's
    # CSV files lose the rows logged after its checkpoint, which it logs again).
    decisions_per_batch = config.num_envs * config.episodes_per_batch * max_decisions
    make_env, options = collection(config, executed, decisions_per_batch, device)
    batch_seed = functools.partial(
        first_reset_seed, config.seed, num_envs=config.num_envs,
        group_size=make_env.group_size, rank=rank, world_size=world_size,
    )  # fmt: skip
    iteration, env_step_count, history = (
        progress[k] for k in ("iteration", "env_steps", "history")
    )
    collector = make_collector(policy, make_env, options, batch_seed(iteration + 1))
    replay_buffer = make_replay_buffer(config, decisions_per_batch, device)
    if main_process:
        resume_step = env_step_count if saved else None
        log = MetricLogger(
            config.loggers, f"ppo_seed{config.seed}", output_dir, config, resume_step
        ).log
    # The random streams where the checkpoint left them, just before the first iteration
    # (under torchrun the checkpoint holds rank 0's streams: one fresh stream per rank).
    if saved is not None and world_size == 1:
        restore_random_state(progress["random_state"])
    elif saved is not None:
        seed_random_generators(config.seed + rank + 1000 * iteration)

    # Training loop: one PPO iteration per batch, evaluation, logging, checkpoints; until
    # the env-step budget is spent (a batch's env steps: its decisions' executed rows).
    bar = tqdm(
        total=config.total_env_steps,
        initial=env_step_count,
        desc="PPO env steps",
        disable=not main_process,
    )
    batches = iter(collector)
    policy_weights = TensorDict.from_module(policy)  # a view: always the current weights
    while env_step_count < config.total_env_steps:
        collected = time.perf_counter()
        seed_batch(collector, options, batch_seed(iteration + 1))  # the batch's initial states
        batch = next(batches)
        collect_seconds = time.perf_counter() - collected
        iteration += 1
        batch_steps = sum_over_processes(env_steps(batch))  # of all ranks
        env_step_count += batch_steps
        train_actor = config.advantage == "grpo" or iteration > config.critic_warmup_iterations
        row = ppo_iteration(learner, batch, replay_buffer, config, train_actor)
        collector.update_policy_weights_(policy_weights)  # the workers sample with them next
        row["iteration"] = iteration
        row["time/collect_seconds"] = collect_seconds
        row["time/update_seconds"] = time.perf_counter() - collected - collect_seconds
        last_iteration = env_step_count >= config.total_env_steps
        if main_process and (iteration % config.eval_every == 0 or last_iteration):
            evaluation = evaluate(policy, eval_env)
            history.append(curve_row(evaluation, env_step_count, iteration, start))
            row["eval/success_rate"] = evaluation["success_rate"]
            row["eval/mean_return"] = evaluation["mean_return"]
            bar.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        if main_process:  # rank 0's own diagnostics
            log(
                {name.replace("loss_", "loss/"): value for name, value in row.items()},
                env_step_count,
            )
        if main_process and iteration % config.checkpoint_every == 0:
            counters = {"iteration": iteration, "env_steps": env_step_count, "history": history}
            save_ppo_run(
                run_checkpoint,
                learner,
                model_config,
                config,
                {**counters, "wall_seconds": time.perf_counter() - start},
            )
        bar.update(batch_steps)
    bar.close()
    shutdown_collector(collector, options, num_threads=config.threads)
    close_distributed()  # no collective call follows: rank 0 alone finishes the run
    if not main_process:
        return {}
    counters = {"iteration": iteration, "env_steps": env_step_count, "history": history}
    save_ppo_run(
        run_checkpoint,
        learner,
        model_config,
        config,
        {**counters, "wall_seconds": time.perf_counter() - start},
    )

    # Evaluation: the final level (a history row unless the last iteration had one), the
    # held-out protocol (BC and PPO under both decodings, the expert), plot and summary.
    final = evaluate(policy, eval_env)
    eval_env.close()
    if not history or history[-1]["env_steps"] != env_step_count:
        history.append(curve_row(final, env_step_count, iteration, start))
    held_out = held_out_protocol(bc_policy, policy, config, executed, name="PPO", device=device)
    title = f"{get_task(config.task).title}: deterministic evaluation (ODE, K = 20)"
    plot_learning_curve(
        history, baselines, output_dir / "learning_curve.png", title=title, label="PPO (sampled)"
    )
    summary = run_summary(
        config, baselines, history, held_out, pretrained_state,
        rl_success=final["success_rate"], rl_return=final["mean_return"],
        wall_seconds=time.perf_counter() - start,
    )  # fmt: skip
    write_json(output_dir / "summary.json", summary)
    bc = baselines["BC (sampled)"]
    print(
        f"curve seeds: BC success {bc['success_rate']:.1%} -> RL success "
        f"{final['success_rate']:.1%} after {env_step_count} env steps "
        f"({summary['wall_seconds'] / 60:.1f} min)"
    )
    print(f"held-out seeds: {held_out['line']}")
    return summary


def curve_row(evaluation: dict[str, float], env_steps: int, iteration: int, start: float) -> dict:
    """One row of the evaluation history (``wall_seconds`` since ``start``)."""
    return {
        "env_steps": env_steps,
        "iteration": iteration,
        "wall_seconds": time.perf_counter() - start,
        **evaluation,
    }


if __name__ == "__main__":
    main(parse_args())
