"""PPO fine-tuning of a pretrained flow policy: the library's main job (Pusher-v5; robosuite
Lift, PickPlaceCan and NutAssemblySquare with ``--task lift`` / ``--task can`` /
``--task square``).

Top to bottom, in CleanRL's order: config -> the pretrained policy (``examples/pretrain.py``
runs first when its checkpoint is missing) and the evaluation baselines -> critic,
``DenoisingClipPPOLoss``, optimisers -> collector -> loop (:func:`ppo_iteration` per batch,
evaluation on the curve seeds, logging, checkpoints) -> the held-out protocol (BC
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
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import ReplayBuffer
from tqdm import tqdm

from torchrl_flowpolicy import SamplerOptions
from torchrl_flowpolicy.tasks import get_task
from torchrl_flowpolicy.training import collectors, distributed, episodes, models, reports, runs
from torchrl_flowpolicy.training.evaluation import decoding_label
from torchrl_flowpolicy.training.loggers import MetricLogger, MetricWindow
from torchrl_flowpolicy.training.protocol import SPLIT_SIZE
from torchrl_flowpolicy.training.run_checks import weights_digest

import pretrain
import run_settings
from common import TaskOptions, option
from ppo_learner import Learner, make_learner, make_replay_buffer, save_ppo_run

# What the options of the noise head require: refused with --noise fixed (nothing reads them).
LEARNED = ("noise", "learned")


# ----------------------------------------------------------------------------- config
@dataclass
class PPOConfig(TaskOptions):
    """PPO fine-tuning settings; every field is a command-line option."""

    seed: int = option(0, "seeds torch, the environments and the pretraining", minimum=0)
    output_dir: str = option("outputs/ppo", "checkpoints, logs, plot and summary")
    pretrained_checkpoint: str = option(
        "outputs/pretrain/policy.pt",
        "the behaviour-cloned policy (the task's default: pretrained here if missing)",
    )
    pretrain_if_missing: bool = option(
        False, "pretrain at pretrained_checkpoint when it is missing (always at the default)"
    )
    num_envs: int = option(32, "training environments (over all collector workers)", minimum=1)
    collector_workers: int = option(1, "collector processes (> 1: MultiSyncCollector)", minimum=1)
    collector_backend: Literal["process", "ray"] = option(
        "process", "ray: one Ray actor per worker"
    )
    ray_address: str = option("", "the Ray cluster (empty: RAY_ADDRESS, ray start's or a new one)")
    device: str = option("cpu", "torch device of the policy, critic, loss and batches")
    episodes_per_batch: int = option(1, "episodes per environment per PPO iteration", minimum=1)
    total_env_steps: int = option(720_000, "environment steps of fine-tuning", minimum=1)
    # The Flow-SDE sampler of rollouts and learner, and the evaluation ODE (--sampler.*):
    # K = 4 rollouts from the noise-free start x_0 = 0, the last 2 steps stochastic; the
    # evaluation ODE at the rollouts' K = 4, the learning curve noise-free (the reported
    # decoding). Chosen on validation states: docs/results.md.
    sampler: SamplerOptions = option(
        SamplerOptions(
            num_denoising_steps=4,
            eval_num_denoising_steps=4,
            sde_mode="last",
            num_sde_steps=2,
            rollout_noise_scale=0.0,
            eval_noise_scale=0.0,
        ),
        "Flow-SDE sampler (rollouts, learner) and evaluation ODE; saved with every checkpoint",
    )
    noise: Literal["fixed", "learned"] = option("fixed", "learned: a fresh noise head (Flow-Noise)")
    min_noise_std: float = option(0.02, "lower bound of the step std", above=0, requires=LEARNED)
    max_noise_std: float = option(0.3, "upper bound of the step std", above=0, requires=LEARNED)
    initial_noise_std: float = option(0.08, "the fresh head's std", above=0, requires=LEARNED)
    noise_learning_rate: float = option(3e-4, "Adam on the noise head", above=0, requires=LEARNED)
    entropy_coeff: float = option(0.0, "entropy bonus (needs noise=learned; 0: off)", minimum=0)
    # PPO.
    advantage: Literal["gae", "grpo"] = option("gae", "grpo: no critic, group-relative returns")
    group_size: int = option(4, "grpo: environments per group (one initial state)", minimum=2)
    epochs: int = option(4, "passes over each batch", minimum=1)
    minibatch_size: int = option(608, "decisions per minibatch", minimum=1)
    actor_learning_rate: float = option(1e-4, "Adam on the flow policy", above=0)
    critic_learning_rate: float = option(1e-3, "Adam on the value network", above=0)
    actor_learning_rate_decay_env_steps: int = option(
        0,
        "the actor's learning rates decay linearly to 0 over the budget's last N env steps "
        "(0: constant)",
        minimum=0,
    )
    clip_epsilon_low: float = option(0.2, "ratio clip below 1", above=0, maximum=1)
    clip_epsilon_high: float = option(0.28, "ratio clip above 1 (clip-higher)", above=0)
    context_grad: bool = option(
        True,
        "the policy gradient also trains the observation encoder (not only the action expert)",
    )
    kl_coeff: float = option(0.0, "KL to the pretrained policy (0: off)", minimum=0)
    bc_coeff: float = option(0.1, "self-imitation on successful episodes (0: off)", minimum=0)
    gamma: float = option(0.99, "discount per env step (grpo: unused)", minimum=0, maximum=1)
    gae_lambda: float = option(0.95, "GAE lambda over decisions", minimum=0, maximum=1)
    reward_scale: float = option(0.1, "multiplies the summed chunk reward", above=0)
    max_grad_norm: float = option(1.0, "gradient clipping", above=0)
    critic_warmup_iterations: int = option(3, "first iterations train the critic only", minimum=0)
    # Evaluation, logging, checkpoints.
    eval_every: int = option(20, "iterations between deterministic evaluations", minimum=1)
    eval_episodes: int = option(
        50, "learning-curve episodes (curve seeds 10000+)", minimum=1, maximum=SPLIT_SIZE
    )
    held_out_episodes: int = option(
        200, "final protocol episodes (seeds 30000+)", minimum=1, maximum=SPLIT_SIZE
    )
    split: Literal["held_out", "validation"] = option(
        "held_out",
        "the final protocol's states: validation to choose settings on, held_out to report",
    )
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "noise_free", "PPO's decoding reported on the held-out states (chosen on validation)"
    )
    checkpoint_every: int = option(20, "iterations between checkpoints", minimum=1)
    loggers: str = option("wandb,csv", "TorchRL loggers, comma-separated (wandb runs offline)")
    resume: bool = option(False, "continue from output_dir/checkpoint.pt")
    overwrite: bool = option(False, "replace the results (checkpoint, summary) in output_dir")
    threads: int = option(2, "torch CPU threads", minimum=1)
    pretrain: pretrain.PretrainConfig = pretrain.run_option()

    def option_conflicts(self) -> list[str]:
        """Options that contradict each other (exit 2 on the command line, ``ValueError`` in
        ``main``), one line each naming them (:func:`run_settings.ppo_conflicts`)."""
        return run_settings.ppo_conflicts(self)

    def option_warnings(self) -> list[str]:
        """Valid settings in which the actor cannot learn, warned about before any work
        (:func:`run_settings.ppo_warnings`)."""
        return run_settings.ppo_warnings(self)


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


def parse_args(argv: list[str] | None = None) -> PPOConfig:
    """The command line (``--help``) as a :class:`PPOConfig`, with the task's defaults."""
    return pretrain.parse_run_args(PPOConfig, argv, "ppo", description=__doc__, quick=QUICK)


def collector_options(
    config: PPOConfig, device: torch.device | str = "cpu"
) -> collectors.CollectorOptions:
    """How the batches are collected."""
    return collectors.CollectorOptions(
        num_envs=config.num_envs,
        workers=config.collector_workers,
        backend=config.collector_backend,
        worker_threads=config.threads,
        ray_address=config.ray_address,
        device=device,
    )


def check_config(config: PPOConfig, world_size: int) -> torch.device:
    """Refuse, before any work, what the run could not do (:func:`~run_settings.check_run_config`,
    and Ray: under ``torchrun``, ``ValueError``; not installed, ``ImportError``); returns the
    run's device."""
    device = run_settings.check_run_config(config)
    if config.collector_backend == "ray" and world_size > 1:
        raise ValueError(
            "--collector_backend ray under torchrun is not supported: use one learner process "
            "with Ray workers, or torchrun with --collector_backend process."
        )
    collector_options(config, device)  # ImportError without Ray
    return device


# ----------------------------------------------------------------------------- env
def training_envs(config: PPOConfig, executed_chunk_length: int) -> collectors.TaskEnvFactory:
    """The chunked training environments, counting env steps; with ``--advantage grpo``
    seeded in groups of ``group_size``."""
    group_size = config.group_size if config.advantage == "grpo" else 1
    options = reports.task_options(config)
    return collectors.TaskEnvFactory(config.task, executed_chunk_length, options, group_size)


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
    the gradients are averaged over the ranks before clipping. ``--advantage grpo``: each
    environment's first episode with its group-relative advantage (no GAE), the actor alone
    trained. Returns the minibatches' mean loss entries and the batch's statistics.
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
    metrics = MetricWindow()  # the loss entries of every minibatch
    fresh_drift = None
    for _ in range(config.epochs):
        for minibatch in replay_buffer:
            losses = loss_module(minibatch)
            if fresh_drift is None:  # before any update: the rollout/learner mismatch alarm
                fresh_drift = losses["log_prob_drift"].item()
            loss = losses["loss_objective"]
            for name in ("loss_kl", "loss_bc", "loss_entropy"):  # 0 or absent unless asked for
                if name in losses.keys():
                    loss = loss + losses[name]
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
                metrics.add(name, float(value.detach()))

    row = metrics.means() | episodes.batch_statistics(batch)  # every batch ends its episodes
    row["log_prob_drift_before_update"] = fresh_drift
    if critic is None:
        row.update(episodes.group_statistics(batch, config.group_size, collected_decisions))
    else:  # the scale of GAE's advantage before the loss normalises it
        row["train/advantage_std"] = batch[loss_module.tensor_keys.advantage].std().item()
    if ("flow", "step_std") in batch.keys(True):  # the rollouts' learned std
        row["train/noise_std"] = batch["flow", "step_std"][batch["flow", "sde_mask"]].mean().item()
    return row


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
    # protocol, with a fresh noise head for --noise learned; the --resume checkpoint is
    # refused now if it is another run's (task, architecture, advantage, noise).
    policy, model_config, _, pretrained_state = pretrain.load_or_pretrain(
        config, config.sampler, device, pretrain_here=main_process
    )
    run_settings.start_noise_head(policy, config)
    origin = {"seed": config.seed, "pretrained_weights": weights_digest(policy.state_dict())}
    bc_policy = copy.deepcopy(policy)
    if config.noise == "learned":  # a fresh head
        low, high, initial = config.min_noise_std, config.max_noise_std, config.initial_noise_std
        policy.noise_head = models.build_noise_head(model_config, low, high, initial).to(device)
    checkpoint = output_dir / "checkpoint.pt"
    noise, advantage = models.noise_record(policy), config.advantage
    identity = runs.run_identity(
        config.task, model_config, advantage=advantage, noise=noise, **origin
    )
    identity["sampler"] = config.sampler.to_dict()
    saved = runs.load_run(checkpoint, identity, runs.IMPLIED_IDENTITY) if config.resume else None
    executed = model_config.executed_chunk_length
    max_decisions = reports.decisions_per_episode(config.max_episode_steps, executed)

    # Evaluation env (curve seeds) and the baselines: BC under both decodings, the expert.
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
        collectors.first_reset_seed,
        config.seed,
        num_envs=config.num_envs,
        group_size=make_env.group_size,
        rank=rank,
        world_size=world_size,
    )
    first_seed = batch_seed(run.iteration + 1)
    collector = collectors.make_collector(
        policy, make_env, options, frames_per_batch=decisions_per_batch, seed=first_seed
    )
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
        learner.set_actor_rates(run.env_steps - batch_steps, config)
        row = ppo_iteration(learner, batch, replay_buffer, config, train_actor)
        collector.update_policy_weights_(weights)  # the workers sample with them next
        row["iteration"] = run.iteration
        row["train/actor_learning_rate"] = learner.actor_optimizer.param_groups[0]["lr"]
        row["time/collect_seconds"] = update_start - collect_start
        row["time/update_seconds"] = time.perf_counter() - update_start
        last = run.env_steps >= config.total_env_steps
        if main_process and (run.iteration % config.eval_every == 0 or last):
            evaluation = reports.evaluate_on_curve(
                policy, eval_env, max_decisions, config.eval_episodes
            )
            run.record(evaluation)
            row |= {f"eval/{name}": evaluation[name] for name in ("success_rate", "mean_return")}
            bar.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        if main_process:  # rank 0's own diagnostics, loss_* as loss/*
            log({key.replace("loss_", "loss/"): row[key] for key in row}, run.env_steps)
        if main_process and run.iteration % config.checkpoint_every == 0:
            save_ppo_run(checkpoint, learner, model_config, config, run, origin)
        bar.update(batch_steps)
    bar.close()
    collectors.shutdown_collector(collector, options, num_threads=config.threads)
    distributed.close_distributed()  # no collective call follows: rank 0 alone finishes
    if not main_process:
        return {}
    save_ppo_run(checkpoint, learner, model_config, config, run, origin)

    # Evaluation: the final level (the last iteration's, evaluated unless it was), the
    # held-out protocol (BC and PPO under both decodings, the expert), plot, summary.json.
    if not run.history or run.history[-1]["env_steps"] != run.env_steps:
        run.record(reports.evaluate_on_curve(policy, eval_env, max_decisions, config.eval_episodes))
    eval_env.close()
    held_out = reports.held_out_protocol(
        bc_policy, policy, config, executed, name="PPO", device=device, split=config.split
    )
    steps = config.sampler.eval_num_denoising_steps
    title = f"{get_task(config.task).title}: deterministic evaluation (ODE, K = {steps})"
    summary = reports.run_summary(
        config, baselines, run.history, held_out, pretrained_state, wall_seconds=run.wall_seconds()
    )
    label = f"PPO ({decoding_label(config.sampler.eval_noise_scale)})"  # the curve's decoding
    reports.write_run_report(output_dir, summary, name="RL", title=title, label=label)
    return summary


if __name__ == "__main__":
    main(parse_args())
