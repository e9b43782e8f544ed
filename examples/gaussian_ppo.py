"""The Gaussian baseline of the main job: TorchRL's stock Gaussian actor, behaviour-cloned on
the flow policy's demonstrations, then fine-tuned with TorchRL's stock ``ClipPPOLoss``
(Pusher-v5; robosuite Lift, PickPlaceCan and NutAssemblySquare with ``--task lift`` /
``--task can`` / ``--task square``).

What a TorchRL user would run instead of the flow policy, on the same terms as
``examples/ppo.py``: the same demonstrations (those ``examples/pretrain.py`` loads for this
seed: ``--demo_seed -1`` takes ``--seed``), the same reward (per env step, scaled by
``--reward_scale``), every batch from fresh resets seeded by the run seed and the iteration,
the same learning-curve seeds, and at the end the same held-out protocol (200 episodes, both
decodings, the expert on the same states, Wilson intervals, paired gain) and ``summary.json``
fields. The actor acts once per env step: it runs on the task environment with executed
chunks of one step (``[1, D]`` actions), so BC and PPO are both evaluated per step (150
decisions per Pusher episode); "sampled" is the actor's TanhNormal sample (RANDOM),
"noise-free" its ``tanh(loc)`` (DETERMINISTIC).

Top to bottom: config -> demonstrations -> actor and critic (the reference
``ppo_mujoco.py`` networks: 2 x 64 Tanh MLPs, a state-independent scale, a fixed
observation normaliser from the demonstrations) -> behaviour cloning (the TanhNormal
log-likelihood of the demonstration actions, loc and scale together,
``torchrl_flowpolicy.training.gaussian_baseline``) -> ``ClipPPOLoss`` with GAE, one Adam -> collector
(this process, or ``--collector_workers N`` processes as in ``examples/ppo.py``) -> loop
(critic warm-up first, evaluation on the curve seeds) -> held-out protocol -> plot,
``summary.json`` and ``checkpoint.pt`` (the actor's and critic's weights, the optimiser, the
counters and every random generator's state, written every ``--checkpoint_every``
iterations too). ``--resume`` continues a stopped run from its checkpoint, bit for bit with
one collector process (worker processes start new sampling streams): the set-up (behaviour
cloning, the curve baselines) runs again as the uninterrupted run did, then the
checkpoint's weights and random streams replace its own; ``--resume --total_env_steps N``
extends a finished run. ``--quick`` runs the chain in well under a minute.
"""

from __future__ import annotations

import copy
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.objectives import ClipPPOLoss, ValueEstimators
from tqdm import tqdm

from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.tasks import TASKS, get_task, load_or_collect_demos
from torchrl_flowpolicy.training import collectors, episodes, reports, runs
from torchrl_flowpolicy.training.gaussian_baseline import (
    behaviour_clone,
    demonstration_log_likelihood,
    make_gaussian_actor,
    make_value_network,
)
from torchrl_flowpolicy.training.loggers import (
    LOGGERS,
    MetricLogger,
    MetricWindow,
    unknown_loggers,
)
from torchrl_flowpolicy.training.protocol import SPLIT_SIZE
from torchrl_flowpolicy.training.run_checks import check_output_dir

import pretrain
from common import TaskOptions, option, parse_config
from run_settings import validate_config

# The actor acts once per env step: the task environment with one-step chunks.
EXECUTED_CHUNK_LENGTH = 1


# ----------------------------------------------------------------------------- config
@dataclass
class GaussianPPOConfig(TaskOptions):
    """Gaussian-baseline settings; every field is a command-line option."""

    seed: int = option(0, "seeds torch, the environments and the demonstrations", minimum=0)
    output_dir: str = option("outputs/gaussian_ppo", "checkpoint, logs, plot and summary")
    overwrite: bool = option(False, "replace the results (checkpoint, summary) in output_dir")
    # Demonstrations: examples/pretrain.py's options, with its defaults and its seed rule.
    demo_dir: str = option("outputs/demos", "demonstration cache (made by the scripted expert)")
    demo_episodes: int = option(5, "scripted-expert episodes to clone (pretrain's)", minimum=1)
    demo_action_noise: float = option(
        0.3, "std of the Gaussian noise on the expert's actions (pretrain's)", minimum=0
    )
    demo_seed: int = option(
        -1, "seed of the demonstration episodes (-1: --seed, as pretrain.py)", minimum=-1
    )
    # Networks and behaviour cloning.
    hidden_dim: int = option(64, "width of the actor's and critic's Tanh layers", minimum=1)
    num_layers: int = option(2, "hidden layers of the actor and the critic", minimum=1)
    bc_steps: int = option(3000, "behaviour-cloning optimiser steps", minimum=1)
    bc_batch_size: int = option(256, "demonstration steps per BC minibatch", minimum=1)
    bc_learning_rate: float = option(1e-3, "Adam on the actor during BC (cosine decay)", above=0)
    bc_action_epsilon: float = option(
        1e-3, "demo actions moved inside the bounds by this share of the half-range", above=0
    )
    # PPO (TorchRL's ClipPPOLoss, the reference ppo_mujoco.py settings).
    num_envs: int = option(16, "training environments (over all collector workers)", minimum=1)
    collector_workers: int = option(1, "collector processes (> 1: MultiSyncCollector)", minimum=1)
    device: str = option("cpu", "torch device of the actor, critic, loss and batches")
    total_env_steps: int = option(480_000, "environment steps of fine-tuning", minimum=1)
    epochs: int = option(10, "passes over each batch", minimum=1)
    minibatch_size: int = option(64, "env steps per minibatch", minimum=1)
    learning_rate: float = option(3e-4, "Adam on the actor and the critic", above=0)
    clip_epsilon: float = option(0.2, "ratio clip", above=0, maximum=1)
    entropy_coeff: float = option(0.0, "entropy bonus (Monte-Carlo estimate; 0: off)", minimum=0)
    critic_coeff: float = option(0.25, "weight of the critic's l2 loss", above=0)
    gamma: float = option(0.99, "discount per env step", minimum=0, maximum=1)
    gae_lambda: float = option(0.95, "GAE lambda", minimum=0, maximum=1)
    reward_scale: float = option(0.1, "multiplies the per-step reward (ppo.py's)", above=0)
    max_grad_norm: float = option(0.5, "gradient clipping", above=0)
    critic_warmup_iterations: int = option(3, "first iterations train the critic only", minimum=0)
    # Evaluation, logging.
    eval_every: int = option(10, "iterations between deterministic evaluations", minimum=1)
    checkpoint_every: int = option(20, "iterations between checkpoints", minimum=1)
    resume: bool = option(False, "continue from output_dir/checkpoint.pt")
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
        "noise_free", "the decoding reported on the held-out states (ppo.py's default)"
    )
    loggers: str = option("wandb,csv", "TorchRL loggers, comma-separated (wandb runs offline)")
    threads: int = option(2, "torch CPU threads", minimum=1)


# What --quick changes: the whole chain in well under a minute.
QUICK = {
    "num_envs": 4,
    "total_env_steps": 4 * 150 * 3,
    "epochs": 2,
    "minibatch_size": 150,
    "bc_steps": 200,
    "eval_every": 2,
    "eval_episodes": 4,
    "held_out_episodes": 4,
    "critic_warmup_iterations": 1,
    "checkpoint_every": 2,
    "loggers": "csv",
    "threads": 1,
}


def task_defaults() -> dict[str, dict[str, Any]]:
    """What ``--task NAME`` changes: the task's options, its demonstrations, its output
    folder and ``examples/ppo.py``'s reward scale for it (the same reward here)."""
    defaults = {}
    for name, task in TASKS.items():
        ppo_defaults = task.run_defaults.get("ppo", {})
        defaults[name] = {
            **task.defaults,
            "output_dir": task.output_dir("gaussian_ppo"),
            "demo_episodes": task.demos.num_episodes,
            "demo_action_noise": task.demos.action_noise,
        }
        if "reward_scale" in ppo_defaults:
            defaults[name]["reward_scale"] = ppo_defaults["reward_scale"]
    return defaults


def parse_args(argv: list[str] | None = None) -> GaussianPPOConfig:
    """The command line (``--help``) as a :class:`GaussianPPOConfig`, with the task's defaults."""
    return parse_config(
        GaussianPPOConfig, argv, description=__doc__, quick=QUICK, task_defaults=task_defaults()
    )


def check_config(config: GaussianPPOConfig) -> torch.device:
    """Refuse, before any work, options out of bounds, an unknown logger and an output folder
    holding another run's results; returns the run's device."""
    validate_config(config)
    unknown = unknown_loggers(config.loggers)
    if unknown:
        raise ValueError(f"--loggers {config.loggers}: {unknown} not among {list(LOGGERS)}.")
    if config.num_envs % config.collector_workers:
        raise ValueError(
            f"--num_envs {config.num_envs}: must be a multiple of --collector_workers "
            f"{config.collector_workers} (envs per worker)."
        )
    check_output_dir(config.output_dir, resume=config.resume, overwrite=config.overwrite)
    if config.resume:
        runs.require_run_checkpoint(Path(config.output_dir) / "checkpoint.pt")
    return runs.resolve_device(config.device)


def run_identity(config: GaussianPPOConfig) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by this run: the task, the seed, the
    demonstrations and the networks' sizes."""
    demonstrations = {
        "episodes": config.demo_episodes,
        "action_noise": config.demo_action_noise,
        "seed": pretrain.demonstration_seed(config),
    }
    networks = {"hidden_dim": config.hidden_dim, "num_layers": config.num_layers}
    return {
        "task": config.task,
        "seed": config.seed,
        "demonstrations": demonstrations,
        "networks": networks,
    }


# ----------------------------------------------------------------------------- demonstrations
def load_demonstrations(config: GaussianPPOConfig) -> dict[str, Any]:
    """The demonstrations ``examples/pretrain.py`` clones for this config and seed (its
    cache, its seed rule :func:`pretrain.demonstration_seed`)."""
    with tqdm(total=config.demo_episodes, desc="demonstrations") as progress:
        demos, path, cached = load_or_collect_demos(
            num_episodes=config.demo_episodes,
            action_noise=config.demo_action_noise,
            seed=pretrain.demonstration_seed(config),
            directory=config.demo_dir,
            progress=progress.update,
            task=config.task,
            **reports.task_options(config),
        )
    print(f"demonstrations {'loaded from' if cached else 'written to'} {path}")
    return demos


# ----------------------------------------------------------------------------- the update
def ppo_iteration(
    loss_module: ClipPPOLoss,
    optimizer: torch.optim.Optimizer,
    batch: TensorDictBase,
    replay_buffer: ReplayBuffer,
    config: GaussianPPOConfig,
    train_actor: bool,
) -> dict[str, float]:
    """Scale rewards, GAE, then ``epochs`` passes of minibatch updates of the critic and,
    with ``train_actor``, the actor (its gradient is not even computed during the critic's
    warm-up). Returns the minibatches' mean loss entries and the batch's statistics."""
    batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
    with torch.no_grad():
        loss_module.value_estimator(batch)
    replay_buffer.empty()
    replay_buffer.extend(batch.reshape(-1))
    parameters = list(loss_module.parameters())
    metrics = MetricWindow()
    for _ in range(config.epochs):
        for minibatch in replay_buffer:
            losses = loss_module(minibatch)
            loss = losses["loss_critic"]
            if train_actor:
                loss = loss + losses["loss_objective"]
                if "loss_entropy" in losses.keys():
                    loss = loss + losses["loss_entropy"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm)
            optimizer.step()
            for name, value in losses.items():
                metrics.add(name, float(value.detach().float().mean()))
    return metrics.means() | episodes.batch_statistics(batch)


# ----------------------------------------------------------------------------- main
def main(config: GaussianPPOConfig) -> dict:
    # Config: device, seeds, output folder.
    device = check_config(config)
    runs.seed_random_generators(config.seed)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    run = runs.RunProgress()
    # The --resume checkpoint is refused now if it is another run's (task, seed,
    # demonstrations, network sizes).
    checkpoint, identity = output_dir / "checkpoint.pt", run_identity(config)
    saved = runs.load_run(checkpoint, identity) if config.resume else None

    # Demonstrations: per-step (observation, action) pairs; the actor's action is [1, D].
    demos = load_demonstrations(config)
    observations = demos["observation"].float()
    actions = demos["action"].float().unsqueeze(1)

    # Actor and critic: the reference networks after the demonstrations' normaliser.
    task = get_task(config.task)
    eval_env = reports.make_eval_env(config, config.eval_episodes, EXECUTED_CHUNK_LENGTH)
    action_spec = eval_env.full_action_spec_unbatched
    normalizer = ObservationNormalizer.from_data(observations)
    networks = {"num_cells": [config.hidden_dim] * config.num_layers}
    networks["observation_normalizer"] = normalizer
    actor = make_gaussian_actor(task.observation_dim, action_spec, **networks)
    critic = make_value_network(task.observation_dim, **networks)

    # Behaviour cloning: maximum TanhNormal likelihood of the demonstration actions.
    bc_start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    bc_options = {"epsilon": config.bc_action_epsilon}
    before = demonstration_log_likelihood(actor, observations, actions, **bc_options).item()
    bc_losses = behaviour_clone(
        actor,
        observations,
        actions,
        steps=config.bc_steps,
        batch_size=config.bc_batch_size,
        learning_rate=config.bc_learning_rate,
        generator=generator,
        **bc_options,
    )
    with torch.no_grad():
        after = demonstration_log_likelihood(actor, observations, actions, **bc_options).item()
    print(f"BC: demonstration log-likelihood {before:.2f} -> {after:.2f} per step")
    actor.to(device)
    critic.to(device)
    bc_actor = copy.deepcopy(actor).requires_grad_(False)  # the protocol's BC, not trained
    bc_summary = {
        "demo_seed": pretrain.demonstration_seed(config),
        "demo_success": demos["success"].float().mean().item(),
        "demo_steps": observations.shape[0],
        "log_likelihood_before": before,
        "log_likelihood_after": after,
        "final_loss": sum(bc_losses[-100:]) / len(bc_losses[-100:]),
        "train_seconds": time.perf_counter() - bc_start,
    }

    # Baselines on the curve seeds: BC under both decodings, the expert.
    max_decisions = reports.decisions_per_episode(config.max_episode_steps, EXECUTED_CHUNK_LENGTH)
    eval_env = eval_env.to(device)
    baselines = reports.curve_baselines(bc_actor, eval_env, max_decisions, config)

    # Loss: TorchRL's ClipPPOLoss, GAE per env step, one Adam on actor and critic.
    loss_module = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=config.clip_epsilon,
        entropy_bonus=config.entropy_coeff > 0,
        entropy_coeff=config.entropy_coeff,
        critic_coeff=config.critic_coeff,
        loss_critic_type="l2",
        normalize_advantage=True,
    )
    loss_module.make_value_estimator(
        ValueEstimators.GAE, gamma=config.gamma, lmbda=config.gae_lambda
    )
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=config.learning_rate)
    trained = {"actor": actor, "critic": critic, "bc_actor": bc_actor, "optimizer": optimizer}
    if saved is not None:
        saved = runs.resume_run(saved, trained)
        run = runs.RunProgress.from_state(saved)
        print(f"resumed from iteration {run.iteration} ({run.env_steps} env steps)")

    # Collector: full episodes from fresh resets seeded by the run seed and the iteration.
    steps_per_batch = config.num_envs * max_decisions
    make_env = collectors.TaskEnvFactory(
        config.task, EXECUTED_CHUNK_LENGTH, reports.task_options(config)
    )
    options = collectors.CollectorOptions(
        num_envs=config.num_envs,
        workers=config.collector_workers,
        worker_threads=config.threads,
        device=device,
    )
    batch_seed = functools.partial(
        collectors.first_reset_seed, config.seed, num_envs=config.num_envs
    )
    collector = collectors.make_collector(
        actor,
        make_env,
        options,
        frames_per_batch=steps_per_batch,
        seed=batch_seed(run.iteration + 1),
    )
    storage = LazyTensorStorage(steps_per_batch, device=device)
    replay_buffer = ReplayBuffer(
        storage=storage, sampler=SamplerWithoutReplacement(), batch_size=config.minibatch_size
    )
    experiment, resume_step = f"gaussian_ppo_seed{config.seed}", run.env_steps if saved else None
    log = MetricLogger(config.loggers, experiment, output_dir, config, resume_step).log
    if saved is not None:  # the random streams where the checkpoint left them
        runs.restore_random_state(saved["random_state"])

    # Loop: one PPO iteration per batch until the env-step budget is spent; checkpoints.
    bar = tqdm(desc="PPO env steps", total=config.total_env_steps)
    bar.update(run.env_steps)
    batches = iter(collector)
    weights = TensorDict.from_module(actor)
    while run.env_steps < config.total_env_steps:
        collect_start = time.perf_counter()
        collectors.seed_batch(collector, options, batch_seed(run.iteration + 1))
        batch = next(batches)
        update_start = time.perf_counter()
        run.iteration += 1
        batch_steps = collectors.env_steps(batch)
        run.env_steps += batch_steps
        train_actor = run.iteration > config.critic_warmup_iterations
        row = ppo_iteration(loss_module, optimizer, batch, replay_buffer, config, train_actor)
        collector.update_policy_weights_(weights)
        row["iteration"] = run.iteration
        row["time/collect_seconds"] = update_start - collect_start
        row["time/update_seconds"] = time.perf_counter() - update_start
        last = run.env_steps >= config.total_env_steps
        if run.iteration % config.eval_every == 0 or last:
            evaluation = reports.evaluate_on_curve(
                actor, eval_env, max_decisions, config.eval_episodes
            )
            run.record(evaluation)
            row |= {f"eval/{name}": evaluation[name] for name in ("success_rate", "mean_return")}
            bar.set_postfix(success=f"{evaluation['success_rate']:.0%}")
        log({key.replace("loss_", "loss/"): row[key] for key in row}, run.env_steps)
        if run.iteration % config.checkpoint_every == 0:
            runs.save_run(checkpoint, trained, **identity, **run.state())
        bar.update(batch_steps)
    bar.close()
    collectors.shutdown_collector(collector, options, num_threads=config.threads)
    eval_env.close()
    runs.save_run(checkpoint, trained, **identity, **run.state())

    # Evaluation: the held-out protocol (BC and PPO under both decodings, the expert, all per
    # env step), plot and summary.json.
    held_out = reports.held_out_protocol(
        bc_actor,
        actor,
        config,
        EXECUTED_CHUNK_LENGTH,
        name="PPO-Gaussian",
        device=device,
        split=config.split,
    )
    wall_seconds = run.wall_seconds()
    pretrained = {"summary": json.dumps(bc_summary)}
    summary = reports.run_summary(
        config, baselines, run.history, held_out, pretrained, wall_seconds=wall_seconds
    )
    title = f"{task.title}: Gaussian actor, deterministic evaluation (tanh(loc))"
    reports.write_run_report(
        output_dir, summary, name="PPO-Gaussian", title=title, label="PPO (Gaussian)"
    )
    return summary


if __name__ == "__main__":
    main(parse_args())
