"""PPO fine-tuning of a pretrained flow policy: the library's main job (Pusher-v5; robosuite
Lift and PickPlaceCan with ``--task lift`` / ``--task can``).

Top to bottom, in CleanRL's order: config -> the pretrained policy (``examples/pretrain.py``
runs first when its checkpoint is missing) and the evaluation baselines -> critic,
``DenoisingClipPPOLoss``, optimisers -> collector -> loop (:func:`ppo_iteration` per batch,
evaluation at K = 20 on the curve seeds, logging, checkpoints) -> the held-out protocol (BC
and PPO under both decodings, the expert, 95 % intervals) -> plot, ``summary.json`` and the
run checkpoint (``torchrl_flowpolicy.load_policy`` reads it). The plumbing is the package's:
``collectors`` (this process, ``--collector_workers N`` processes, or Ray actors), ``runs``
(seeding, checkpoints, resume), ``models``, ``loggers``, ``episodes`` and ``reports``.

Modes: ``--advantage grpo`` (no critic, group-relative returns; docs/grpo.md), ``--noise
learned`` (a fresh noise head; docs/learned_noise.md), ``torchrun --nproc_per_node N`` (data-
parallel learner, rank 0 evaluates and saves; docs/scaling.md), ``--device cuda``. Every
batch starts from fresh resets seeded by the run seed and the iteration, and the checkpoint
holds every random generator's state: ``--resume`` continues a killed run bit for bit with
one collector process (tests/test_main_job.py). ``--quick`` runs the chain in about a minute.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.objectives import ValueEstimators
from tqdm import tqdm

from torchrl_flowpolicy import (
    FlowSDEPolicy,
    SamplerOptions,
    collectors,
    distributed,
    episodes,
    models,
    reports,
    runs,
)
from torchrl_flowpolicy.envs import decision_discount, get_task
from torchrl_flowpolicy.evaluation import evaluate_policy
from torchrl_flowpolicy.loggers import MetricLogger
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.protocol import CURVE_SEED

import pretrain
from common import TaskOptions, option, parse_config, task_defaults, validate_config

# The options of the noise head: refused with --noise fixed, where nothing reads them.
LEARNED_NOISE_OPTIONS = (
    "min_noise_std",
    "max_noise_std",
    "initial_noise_std",
    "noise_learning_rate",
)


# ----------------------------------------------------------------------------- config
@dataclass
class PPOConfig(TaskOptions):
    """PPO fine-tuning settings; every field is a command-line option."""

    seed: int = option(0, "seeds torch, the environments and the pretraining", minimum=0)
    output_dir: str = option("outputs/ppo", "checkpoints, logs, plot and summary")
    pretrained_checkpoint: str = option(
        "outputs/pretrain/policy.pt", "the behaviour-cloned policy (pretrained here if missing)"
    )
    num_envs: int = option(16, "training environments (over all collector workers)", minimum=1)
    collector_workers: int = option(
        1, "collector processes (> 1: MultiSyncCollector, weights sent per update)", minimum=1
    )
    collector_backend: Literal["process", "ray"] = option(
        "process", "process: this process or worker processes; ray: one Ray actor per worker"
    )
    ray_address: str = option(
        "", "the Ray cluster (empty: RAY_ADDRESS, `ray start`'s or a new local one; auto)"
    )
    device: str = option("cpu", "torch device of the policy, critic, loss and batches")
    episodes_per_batch: int = option(1, "episodes per environment per PPO iteration", minimum=1)
    total_env_steps: int = option(1_200_000, "environment steps of fine-tuning", minimum=1)
    # Flow-SDE sampler (rollouts) and the evaluation ODE.
    noise_level: float = option(0.5, "a: exploration noise of the Flow-SDE step", minimum=0)
    rollout_noise_scale: float = option(
        1.0, "std of the rollouts' (and the learning curve's) x_0", minimum=0
    )
    num_denoising_steps: int = option(
        8, "K: denoising steps of rollouts and of the learner", minimum=1
    )
    eval_num_denoising_steps: int = option(20, "K of the deterministic evaluation ODE", minimum=1)
    sde_mode: Literal["mixed", "last", "all"] = option(
        "last", "stochastic steps: one random step (mixed), the last num_sde_steps, all"
    )
    num_sde_steps: int = option(4, "stochastic steps for sde_mode=last", minimum=0)
    noise: Literal["fixed", "learned"] = option(
        "fixed", "step noise: fixed (Flow-SDE) or learned (a fresh noise head; Flow-Noise)"
    )
    min_noise_std: float = option(0.02, "noise=learned: lower bound of the step std", above=0)
    max_noise_std: float = option(0.3, "noise=learned: upper bound of the step std", above=0)
    initial_noise_std: float = option(0.08, "noise=learned: the fresh head's std", above=0)
    noise_learning_rate: float = option(3e-4, "noise=learned: Adam on the noise head", above=0)
    entropy_coeff: float = option(0.0, "entropy bonus (needs noise=learned; 0: off)", minimum=0)
    # PPO.
    advantage: Literal["gae", "grpo"] = option(
        "gae", "gae: a critic and GAE; grpo: no critic, returns against their group's"
    )
    group_size: int = option(4, "grpo: environments per group (one initial state)", minimum=2)
    epochs: int = option(4, "passes over each batch", minimum=1)
    minibatch_size: int = option(304, "decisions per minibatch", minimum=1)
    actor_learning_rate: float = option(3e-5, "Adam on the flow policy", above=0)
    critic_learning_rate: float = option(1e-3, "Adam on the value network", above=0)
    clip_epsilon_low: float = option(0.2, "ratio clip below 1", above=0, maximum=1)
    clip_epsilon_high: float = option(0.28, "ratio clip above 1 (clip-higher)", above=0)
    kl_coeff: float = option(0.0, "KL to the pretrained policy (0: off)", minimum=0)
    bc_coeff: float = option(0.1, "self-imitation on successful episodes (0: off)", minimum=0)
    gamma: float = option(0.99, "discount per env step (grpo: unused)", minimum=0, maximum=1)
    gae_lambda: float = option(0.95, "GAE lambda over decisions", minimum=0, maximum=1)
    reward_scale: float = option(0.1, "multiplies the summed chunk reward", above=0)
    max_grad_norm: float = option(1.0, "gradient clipping", above=0)
    critic_warmup_iterations: int = option(3, "first iterations train the critic only", minimum=0)
    # Evaluation, logging, checkpoints.
    eval_every: int = option(20, "iterations between deterministic evaluations", minimum=1)
    eval_episodes: int = option(50, "learning-curve episodes (curve seeds 10000+)", minimum=1)
    held_out_episodes: int = option(200, "final protocol episodes (seeds 30000+)", minimum=1)
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "noise_free", "PPO's decoding reported on the held-out states (chosen on validation)"
    )
    checkpoint_every: int = option(20, "iterations between checkpoints", minimum=1)
    loggers: str = option("wandb,csv", "TorchRL loggers, comma-separated (wandb runs offline)")
    resume: bool = option(False, "continue from output_dir/checkpoint.pt")
    threads: int = option(2, "torch CPU threads", minimum=1)
    pretrain: pretrain.PretrainConfig = option(
        default_factory=pretrain.PretrainConfig,
        help="behaviour cloning, run when pretrained_checkpoint is missing (with this run's "
        "seed and task settings; it writes pretrained_checkpoint)",
    )

    def option_conflicts(self) -> list[str]:
        """Options that contradict each other (exit 2 on the command line, ``ValueError`` in
        ``main``), one line each naming them."""
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        changed = [name for name in LEARNED_NOISE_OPTIONS if getattr(self, name) != defaults[name]]
        given = " ".join(f"--{name} {getattr(self, name)}" for name in changed)
        fixed, grpo = self.noise == "fixed", self.advantage == "grpo"
        bounds = (self.min_noise_std, self.initial_noise_std, self.max_noise_std)
        workers = f"--collector_workers {self.collector_workers} --collector_backend "
        rules = [
            (not fixed and not bounds[0] < bounds[1] < bounds[2], "--noise learned needs "
             "--min_noise_std < --initial_noise_std < --max_noise_std, got {} < {} < {}: the "
             "std starts strictly inside its bounds".format(*bounds)),
            (fixed and changed, f"{given}: only with --noise learned (the std is --noise_level's)"),
            (fixed and self.entropy_coeff > 0, f"--entropy_coeff {self.entropy_coeff}: needs "
             "--noise learned (the fixed schedule's entropy has no gradient)"),
            (self.num_envs % self.collector_workers, f"--num_envs {self.num_envs}: must be a "
             f"multiple of --collector_workers {self.collector_workers} (envs per worker)"),
            (grpo and self.num_envs % self.group_size, f"--num_envs {self.num_envs}: must be a "
             f"multiple of --group_size {self.group_size} with --advantage grpo"),
            (grpo and self.episodes_per_batch != 1, f"--episodes_per_batch "
             f"{self.episodes_per_batch}: must be 1 with --advantage grpo (one episode per env)"),
            (grpo and (self.collector_workers != 1 or self.collector_backend != "process"),
             f"{workers}{self.collector_backend}: must be 1 and process with --advantage grpo "
             "(the groups are reseeded from this process)"),
        ]  # fmt: skip
        return [message for broken, message in rules if broken]


# What --quick changes: the whole chain in about a minute.
QUICK = {
    "num_envs": 4, "total_env_steps": 4 * 150 * 4, "epochs": 2, "minibatch_size": 76,
    "eval_every": 2, "checkpoint_every": 2, "eval_episodes": 8, "held_out_episodes": 8,
    "critic_warmup_iterations": 1, "group_size": 2, "pretrain.train_steps": 150,
    "pretrain.eval_episodes": 8, "threads": 1,
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> PPOConfig:
    """The command line (``--help``) as a :class:`PPOConfig`."""
    exclude = [f"pretrain.{name}" for name in (*pretrain.RUN_SETTINGS, *pretrain.EXCLUDE)]
    return parse_config(
        PPOConfig,
        argv,
        description=__doc__,
        quick=QUICK,
        task_defaults=task_defaults("ppo"),  # the task's defaults: envs.tasks.TASKS
        exclude=exclude,
    )


def sampler_options(config: PPOConfig) -> SamplerOptions:
    """The flow policy's sampler settings (rollouts, learner, evaluation)."""
    return SamplerOptions(
        num_denoising_steps=config.num_denoising_steps,
        eval_num_denoising_steps=config.eval_num_denoising_steps,
        noise_level=config.noise_level,
        rollout_noise_scale=config.rollout_noise_scale,
        eval_noise_scale=config.rollout_noise_scale,
        sde_mode=config.sde_mode,
        num_sde_steps=config.num_sde_steps,
    )


def collector_options(config: PPOConfig, device: torch.device | str = "cpu"):
    """How the batches are collected (:class:`~torchrl_flowpolicy.collectors.CollectorOptions`)."""
    return collectors.CollectorOptions(
        num_envs=config.num_envs,
        workers=config.collector_workers,
        backend=config.collector_backend,
        worker_threads=config.threads,
        ray_address=config.ray_address,
        device=device,
    )


def check_config(config: PPOConfig, world_size: int) -> torch.device:
    """Refuse, before any work, what the run could not do; returns the run's device.

    Raises:
        ValueError: options out of bounds or contradicting each other (learned-noise bounds
            that do not nest, ...), an unavailable ``--device``, Ray under ``torchrun``.
        ImportError: ``--collector_backend ray`` without Ray. FileNotFoundError: ``--resume``
            without a checkpoint in ``output_dir``.
    """
    validate_config(config)
    device = runs.resolve_device(config.device)
    if config.collector_backend == "ray" and world_size > 1:
        raise ValueError(
            "--collector_backend ray under torchrun is not supported: use one learner process "
            "with Ray workers, or torchrun with --collector_backend process."
        )
    collector_options(config, device)  # ImportError without Ray
    if config.resume:
        runs.require_run_checkpoint(Path(config.output_dir) / "checkpoint.pt")
    return device


# ----------------------------------------------------------------------------- env
def training_envs(config: PPOConfig, executed_chunk_length: int) -> collectors.TaskEnvFactory:
    """The chunked training environments, counting env steps; with ``--advantage grpo``
    seeded in groups of ``group_size``."""
    group_size = config.group_size if config.advantage == "grpo" else 1
    options = reports.task_options(config)
    return collectors.TaskEnvFactory(config.task, executed_chunk_length, options, group_size)


# ----------------------------------------------------------------------------- policy, critic, loss
def add_noise_head(
    policy: FlowSDEPolicy, config: PPOConfig, model_config: models.ModelConfig
) -> None:
    """``--noise learned``: a fresh noise head for RL (the pretrained policy has none)."""
    if config.noise == "learned":
        low, high, initial = config.min_noise_std, config.max_noise_std, config.initial_noise_std
        head = models.build_noise_head(model_config, low, high, initial)
        policy.noise_head = head.to(policy.encoder[0].loc.device)


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
        trained = {"policy": self.policy, "critic": self.critic}
        trained |= {
            "actor_optimizer": self.actor_optimizer,
            "critic_optimizer": self.critic_optimizer,
        }
        return {name: item for name, item in trained.items() if item is not None}


def make_learner(policy: FlowSDEPolicy, config: PPOConfig, executed_chunk_length: int) -> Learner:
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
    config: PPOConfig, decisions_per_batch: int, device: torch.device | str = "cpu"
) -> ReplayBuffer:
    """One batch of decisions on ``device``, served in ``minibatch_size`` minibatches without
    replacement (one epoch per pass)."""
    storage = LazyTensorStorage(decisions_per_batch, device=device)
    sampler = SamplerWithoutReplacement()
    return ReplayBuffer(storage=storage, sampler=sampler, batch_size=config.minibatch_size)


# ----------------------------------------------------------------------------- the update
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
    (:func:`~torchrl_flowpolicy.episodes.group_relative_episodes`) instead of GAE, and the
    actor alone is trained. Returns the loss entries averaged over the minibatches and the
    batch's training statistics.
    """
    policy, critic, loss_module = learner.policy, learner.critic, learner.loss_module
    batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
    if config.bc_coeff > 0:
        batch["success"] = episodes.episode_success_flags(batch)
    collected_decisions = batch.numel()
    if critic is None:  # grpo
        batch = episodes.group_relative_episodes(batch, config.group_size)
    else:
        with torch.no_grad():
            loss_module.value_estimator(batch)
    replay_buffer.empty()
    replay_buffer.extend(batch.reshape(-1))
    trained = [(policy, learner.actor_optimizer)]  # grpo: the actor alone
    if critic is not None:
        trained.insert(0, (critic, learner.critic_optimizer))
    parameters = [parameter for network, _ in trained for parameter in network.parameters()]
    metrics: dict[str, list[float]] = {}
    fresh_drift = None
    for _ in range(config.epochs):
        for minibatch in replay_buffer:
            losses = loss_module(minibatch)
            if fresh_drift is None:  # before any update: the rollout/learner mismatch alarm
                fresh_drift = losses["log_prob_drift"].item()
            loss = losses["loss_objective"]
            for name in ("loss_kl", "loss_bc"):
                if name in losses.keys():
                    loss = loss + losses[name]
            if config.entropy_coeff > 0:
                loss = loss + losses["loss_entropy"]
            if critic is not None:  # the critic always, the actor after the warm-up
                loss = losses["loss_critic"] + (loss if train_actor else 0.0)
            for _, optimizer in trained:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            distributed.average_gradients(parameters)  # over the ranks (torchrun)
            for network, optimizer in trained:
                if network is policy and critic is not None and not train_actor:
                    continue  # the critic's warm-up
                torch.nn.utils.clip_grad_norm_(network.parameters(), config.max_grad_norm)
                optimizer.step()
            for name, value in losses.items():
                metrics.setdefault(name, []).append(float(value.detach()))

    done = batch["next", "done"].squeeze(-1)
    row = {name: sum(values) / len(values) for name, values in metrics.items()}
    success = batch["next", "success"].squeeze(-1)[done].float()
    row["train/episode_success"] = success.mean().item() if done.any() else 0.0
    row["train/chunk_reward"] = batch["next", "reward"].mean().item()
    row["log_prob_drift_before_update"] = fresh_drift
    if critic is None:
        row.update(episodes.group_statistics(batch, config.group_size, collected_decisions))
    if ("flow", "step_std") in batch.keys(True):  # the rollouts' learned std
        row["train/noise_std"] = batch["flow", "step_std"][batch["flow", "sde_mask"]].mean().item()
    return row


# ----------------------------------------------------------------------------- checkpoints
# What a checkpoint saved before an entry of run_identity was recorded implies: every run had
# a critic before GRPO and the fixed Flow-SDE noise before the noise head.
IMPLIED_IDENTITY = {"advantage": "gae", "noise": {"kind": "fixed"}}


def run_identity(config: PPOConfig, model_config: models.ModelConfig) -> dict[str, Any]:
    """What a resumed checkpoint must share with this run: the task, the pretrained policy's
    architecture (chunking included), the advantage and the exploration noise."""
    noise = {"kind": config.noise}
    if config.noise == "learned":
        noise |= {"min_std": config.min_noise_std, "max_std": config.max_noise_std}
    return {
        "task": config.task,
        "model_config": dataclasses.asdict(model_config),
        "advantage": config.advantage,
        "noise": noise,
    }


def save_ppo_run(
    path: Path,
    learner: Learner,
    model_config: models.ModelConfig,
    config: PPOConfig,
    run: runs.RunProgress,
) -> None:
    """The run checkpoint ``--resume`` reads: what the learner trains, the progress
    (:class:`~torchrl_flowpolicy.runs.RunProgress`), the advantage, and the policy's record
    (:func:`~torchrl_flowpolicy.models.policy_record`: architecture, task, sampler settings,
    noise), with which ``load_policy`` rebuilds the fine-tuned policy."""
    record = models.policy_record(learner.policy, model_config, config.task)
    trained, advantage = learner.trained(), config.advantage
    runs.save_run(path, trained, **run.state(), advantage=advantage, **record)


# ----------------------------------------------------------------------------- main
def main(config: PPOConfig) -> dict:
    # Config: this process's rank, device and seeds; the output folder.
    rank, world_size = distributed.init_distributed()  # (0, 1) unless launched by torchrun
    device = check_config(config, world_size)  # unavailable device, bad split: fail now
    main_process = rank == 0
    runs.seed_random_generators(config.seed + rank)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    run = runs.RunProgress()

    # Policy: the pretrained one (made first when missing, by rank 0), kept as BC for the
    # protocol; the --resume checkpoint is refused now if it is another run's.
    pretrained = Path(config.pretrained_checkpoint)
    if main_process and not pretrained.is_file():
        pretrain.main(pretrain.config_for_run(config))
    distributed.barrier()
    policy, model_config, _, pretrained_state = models.load_policy_checkpoint(
        pretrained, sampler=sampler_options(config), task=config.task
    )
    policy.to(device)
    checkpoint = output_dir / "checkpoint.pt"
    identity = run_identity(config, model_config)
    saved = runs.load_run(checkpoint, identity, IMPLIED_IDENTITY) if config.resume else None
    bc_policy = copy.deepcopy(policy)
    add_noise_head(policy, config, model_config)
    executed = model_config.executed_chunk_length
    max_decisions = reports.decisions_per_episode(config.max_episode_steps, executed)

    # Evaluation env (curve seeds) and the baselines: BC under both decodings, the expert.
    evaluate = functools.partial(
        evaluate_policy, max_decisions=max_decisions, seed=CURVE_SEED,
        num_episodes=config.eval_episodes,
    )  # fmt: skip
    if main_process:
        eval_env = reports.make_eval_env(config, config.eval_episodes, executed, device)
        baselines = reports.curve_baselines(policy, eval_env, max_decisions, config)

    # Critic, loss, optimisers (resumed if asked); every rank starts from rank 0's weights.
    learner = make_learner(policy, config, executed)
    if saved is not None:
        saved = runs.resume_run(saved, learner.trained())
        run = runs.RunProgress.from_state(saved)
        print(f"resumed from iteration {run.iteration} ({run.env_steps} env steps)")
    for network in filter(None, (learner.policy, learner.critic)):
        distributed.broadcast_parameters(network)

    # Collector (a batch: episodes_per_batch episodes per env, from fresh resets seeded per
    # iteration), minibatches, logger (a resumed run's CSV files lose the rows logged after
    # its checkpoint, which it logs again).
    decisions_per_batch = config.num_envs * config.episodes_per_batch * max_decisions
    make_env, options = training_envs(config, executed), collector_options(config, device)
    batch_seed = functools.partial(
        collectors.first_reset_seed, config.seed, num_envs=config.num_envs,
        group_size=make_env.group_size, rank=rank, world_size=world_size,
    )  # fmt: skip
    collector = collectors.make_collector(
        policy, make_env, options, frames_per_batch=decisions_per_batch,
        seed=batch_seed(run.iteration + 1),
    )  # fmt: skip
    replay_buffer = make_replay_buffer(config, decisions_per_batch, device)
    if main_process:
        experiment, resume_step = f"ppo_seed{config.seed}", run.env_steps if saved else None
        log = MetricLogger(config.loggers, experiment, output_dir, config, resume_step).log
    # The random streams where the checkpoint left them, just before the first iteration
    # (under torchrun it holds rank 0's streams: a fresh stream per rank).
    if saved is not None and world_size == 1:
        runs.restore_random_state(saved["random_state"])
    elif saved is not None:
        runs.seed_random_generators(config.seed + rank + 1000 * run.iteration)

    # Loop: one PPO iteration per batch, evaluation, logging, checkpoints, until the
    # env-step budget is spent (a batch's env steps: its decisions' executed rows).
    bar = tqdm(desc="PPO env steps", total=config.total_env_steps, disable=rank > 0)
    bar.update(run.env_steps)
    batches = iter(collector)
    weights = TensorDict.from_module(policy)  # a view: always the current weights
    while run.env_steps < config.total_env_steps:
        collect_start = time.perf_counter()
        collectors.seed_batch(collector, options, batch_seed(run.iteration + 1))
        batch = next(batches)
        update_start = time.perf_counter()
        run.iteration += 1
        batch_steps = distributed.sum_over_processes(collectors.env_steps(batch))  # all ranks
        run.env_steps += batch_steps
        train_actor = config.advantage == "grpo" or run.iteration > config.critic_warmup_iterations
        row = ppo_iteration(learner, batch, replay_buffer, config, train_actor)
        collector.update_policy_weights_(weights)  # the workers sample with them next
        row["iteration"] = run.iteration
        row["time/collect_seconds"] = update_start - collect_start
        row["time/update_seconds"] = time.perf_counter() - update_start
        last = run.env_steps >= config.total_env_steps
        if main_process and (run.iteration % config.eval_every == 0 or last):
            evaluation = evaluate(policy, eval_env)
            run.record(evaluation)
            row |= {f"eval/{name}": evaluation[name] for name in ("success_rate", "mean_return")}
            bar.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        if main_process:  # rank 0's own diagnostics
            log(
                {name.replace("loss_", "loss/"): value for name, value in row.items()},
                run.env_steps,
            )
        if main_process and run.iteration % config.checkpoint_every == 0:
            save_ppo_run(checkpoint, learner, model_config, config, run)
        bar.update(batch_steps)
    bar.close()
    collectors.shutdown_collector(collector, options, num_threads=config.threads)
    distributed.close_distributed()  # no collective call follows: rank 0 alone finishes
    if not main_process:
        return {}
    save_ppo_run(checkpoint, learner, model_config, config, run)

    # Evaluation: the final level (a history row unless the last iteration had one), the
    # held-out protocol (BC and PPO under both decodings, the expert), plot and summary.
    final = evaluate(policy, eval_env)
    eval_env.close()
    if not run.history or run.history[-1]["env_steps"] != run.env_steps:
        run.record(final)
    held_out = reports.held_out_protocol(
        bc_policy, policy, config, executed, name="PPO", device=device
    )
    title = f"{get_task(config.task).title}: deterministic evaluation (ODE, K = 20)"
    curve = output_dir / "learning_curve.png"
    reports.plot_learning_curve(run.history, baselines, curve, title=title, label="PPO (sampled)")
    summary = reports.run_summary(
        config, baselines, run.history, held_out, pretrained_state,
        rl_success=final["success_rate"], rl_return=final["mean_return"],
        wall_seconds=run.wall_seconds(),
    )  # fmt: skip
    runs.write_json(output_dir / "summary.json", summary)
    bc = baselines["BC (sampled)"]
    print(
        f"curve seeds: BC success {bc['success_rate']:.1%} -> RL success "
        f"{final['success_rate']:.1%} after {run.env_steps} env steps "
        f"({summary['wall_seconds'] / 60:.1f} min)"
    )
    print(f"held-out seeds: {held_out['line']}")
    return summary


if __name__ == "__main__":
    main(parse_args())
