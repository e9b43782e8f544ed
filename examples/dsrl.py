"""DSRL: stock TorchRL SAC in the initial-noise space of a frozen flow policy (Pusher-v5;
robosuite Lift, Can and Square with ``--task``).

Top to bottom: config -> the frozen pretrained policy (``examples/pretrain.py`` runs first
when its checkpoint is missing) and its baselines on the learning-curve seeds (BC under both
decodings, the expert) -> the noise environments
(:class:`~torchrl_flowpolicy.dsrl.NoiseActionTransform`: the action is the policy's initial
noise ``x_0 in [-m, m]^(H x D)``, the env executes the chunk the deterministic ODE decodes
from it) -> SAC (a tanh-Gaussian noise actor, two critics, automatic temperature;
``torchrl_flowpolicy.dsrl_networks``), the replay buffer -> the loop (collect, ``utd_ratio``
updates per decision, log, evaluate the actor's mean noise, checkpoint) -> the held-out
protocol (BC and DSRL under both decodings: the actor's sampled noise and its mean noise)
-> plot and ``summary.json``.

The defaults suit this policy, whose good chunks lie near ``x_0 = 0``: a small box (m = 0.3,
not DSRL's 1.5), the actor's mean starting at ``x_0 = 0``, critics trained alone first
(docs/dsrl.md). ``--resume`` continues a killed run, replay buffer and random generators
included; unlike ``examples/ppo.py`` it is not bit-identical (the episodes in progress at
the checkpoint are lost). ``--device cuda`` puts the policies, SAC, the env tensors and the
replay buffer on the GPU; the simulators stay on the CPU. ``--quick``: under a minute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from torchrl.data import Composite, LazyTensorStorage, RandomSampler, ReplayBuffer
from torchrl.envs import EnvBase
from torchrl.modules import ProbabilisticActor
from torchrl.objectives import SACLoss, SoftUpdate
from tqdm import tqdm

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.dsrl import DECODED_ACTION_KEY, NoiseActionTransform
from torchrl_flowpolicy.dsrl_networks import (
    make_noise_actor,
    make_noise_critic,
    target_entropy_per_dim,
)
from torchrl_flowpolicy.envs import decision_discount
from torchrl_flowpolicy.tasks import get_task
from torchrl_flowpolicy.training import collectors, episodes, reports, runs
from torchrl_flowpolicy.training.loggers import MetricLogger, MetricWindow
from torchrl_flowpolicy.training.protocol import SPLIT_SIZE, training_seed
from torchrl_flowpolicy.training.run_checks import weights_digest

import pretrain
import run_settings
from common import TaskOptions, option
from dsrl_runs import Progress, resume_dsrl_run, save_dsrl_run


# ----------------------------------------------------------------------------- config
@dataclass
class DSRLConfig(TaskOptions):
    """DSRL (SAC on the noise) settings; every field is a command-line option."""

    seed: int = option(0, "seeds torch, the environments and the pretraining", minimum=0)
    output_dir: str = option("outputs/dsrl", "checkpoints, logs, plot and summary")
    pretrained_checkpoint: str = option(
        "outputs/pretrain/policy.pt",
        "the behaviour-cloned policy (the task's default: pretrained here if missing)",
    )
    pretrain_if_missing: bool = option(
        False, "pretrain at pretrained_checkpoint when it is missing (always at the default)"
    )
    num_envs: int = option(16, "environments stepped in the collector's process", minimum=1)
    decisions_per_batch: int = option(2, "decisions per env between update rounds", minimum=1)
    total_env_steps: int = option(300_000, "environment steps of fine-tuning", minimum=1)
    random_env_steps: int = option(
        5_000, "first env steps act with uniform noise (no updates before)", minimum=0
    )
    eval_num_denoising_steps: int = option(
        0, "K of the decoding ODE (0: the pretrained checkpoint's own sampler settings)", minimum=0
    )
    # DSRL noise space and SAC.
    noise_bound: float = option(0.3, "m: the noise lies in [-m, m]^(H x D) (DSRL: 1.5)", above=0)
    utd_ratio: float = option(0.25, "gradient updates per collected decision", above=0)
    batch_size: int = option(256, "decisions per update", minimum=1)
    buffer_size: int = option(0, "replay capacity in decisions (0: the whole run)", minimum=0)
    hidden_dim: int = option(256, "width of the actor's and critics' LayerNorm MLPs", minimum=1)
    num_layers: int = option(3, "hidden layers of the actor and of each critic", minimum=0)
    actor_learning_rate: float = option(1e-4, "Adam on the noise actor", above=0)
    critic_learning_rate: float = option(3e-4, "Adam on the two critics", above=0)
    alpha_learning_rate: float = option(3e-4, "Adam on log(alpha), the temperature", above=0)
    alpha_init: float = option(0.01, "initial entropy temperature", above=0)
    zero_mean_init: bool = option(True, "start the actor's mean at x_0 = 0 (the noise-free chunk)")
    critic_warmup_updates: int = option(2_000, "first updates train the critics only", minimum=0)
    target_entropy_per_dim: float = option(
        float("nan"), "SAC target entropy per noise dimension (nan: log(m) - 1; < log(2m))"
    )
    gamma: float = option(0.99, "discount per env step", minimum=0, maximum=1)
    tau: float = option(0.005, "Polyak rate of the target critics", above=0, maximum=1)
    reward_scale: float = option(10.0, "multiplies the summed chunk reward", above=0)
    # Evaluation, logging, checkpoints.
    eval_every_env_steps: int = option(20_000, "env steps between evaluations", minimum=1)
    eval_episodes: int = option(
        50, "learning-curve episodes (curve seeds 10000+)", minimum=1, maximum=SPLIT_SIZE
    )
    held_out_episodes: int = option(
        200, "final protocol episodes (seeds 30000+)", minimum=1, maximum=SPLIT_SIZE
    )
    reported_decoding: Literal["sampled", "noise_free"] = option(
        "noise_free", "DSRL's decoding reported on the held-out states (noise_free: mean noise)"
    )
    log_every_env_steps: int = option(2_000, "env steps between logged training metrics", minimum=1)
    checkpoint_every_env_steps: int = option(20_000, "env steps between checkpoints", minimum=1)
    loggers: str = option("wandb,csv", "TorchRL loggers, comma-separated (wandb runs offline)")
    resume: bool = option(False, "continue from output_dir/checkpoint.pt")
    overwrite: bool = option(False, "replace the results (checkpoint, summary) in output_dir")
    threads: int = option(1, "torch CPU threads", minimum=1)
    device: str = option("cpu", "torch device of the policies, SAC, env tensors and buffer")
    pretrain: pretrain.PretrainConfig = pretrain.run_option()

    def option_conflicts(self) -> list[str]:
        """Options that contradict each other, one line each naming them."""
        return run_settings.resume_or_overwrite(self)

    def option_warnings(self) -> list[str]:
        """Valid settings in which SAC cannot learn, warned about before any work
        (:func:`run_settings.dsrl_warnings`)."""
        return run_settings.dsrl_warnings(self)


# What --quick changes: the whole chain in under a minute.
QUICK = {
    "num_envs": 4,
    "total_env_steps": 4 * 150 * 2,
    "random_env_steps": 4 * 150 // 2,
    "utd_ratio": 1.0,
    "critic_warmup_updates": 50,
    "batch_size": 64,
    "hidden_dim": 64,
    "eval_every_env_steps": 600,
    "log_every_env_steps": 300,
    "checkpoint_every_env_steps": 600,
    "eval_episodes": 8,
    "held_out_episodes": 8,
    "pretrain.train_steps": 150,
    "pretrain.eval_episodes": 8,
}


def parse_args(argv: list[str] | None = None) -> DSRLConfig:
    """The command line (``--help``) as a :class:`DSRLConfig`, with the task's defaults."""
    return pretrain.parse_run_args(DSRLConfig, argv, "dsrl", description=__doc__, quick=QUICK)


# ----------------------------------------------------------------------------- env
def make_noise_env(
    policy: FlowSDEPolicy, config: DSRLConfig, num_envs: int, executed_chunk_length: int
) -> EnvBase:
    """``num_envs`` chunked task envs whose action is the frozen policy's noise (counting
    env steps), their tensors on the policy's device (the simulators run on the CPU)."""
    device = policy.encoder[0].loc.device
    options = reports.task_options(config)
    env = collectors.make_task_env(
        config.task,
        num_envs,
        executed_chunk_length,
        task_options=options,
        count_steps=True,
        device=device,
    )
    return env.append_transform(NoiseActionTransform(policy, noise_bound=config.noise_bound))


# ----------------------------------------------------------------------------- actor, critics, SAC
@dataclass
class Learner:
    """SAC on the noise: the loss (actor, two critics, temperature), its target updates and
    one Adam per part; :meth:`trained` is what a run checkpoint holds."""

    loss_module: SACLoss
    target_updater: SoftUpdate
    actor_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer
    alpha_optimizer: torch.optim.Optimizer

    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return (self.actor_optimizer, self.critic_optimizer, self.alpha_optimizer)

    def trained(self) -> dict[str, Any]:
        return {
            "loss_module": self.loss_module,
            "actor_optimizer": self.actor_optimizer,
            "critic_optimizer": self.critic_optimizer,
            "alpha_optimizer": self.alpha_optimizer,
        }


def make_learner(
    policy: FlowSDEPolicy, noise_spec: Composite, config: DSRLConfig, executed_chunk_length: int
) -> tuple[ProbabilisticActor, Learner]:
    """The noise actor and its SAC learner (automatic temperature, decision discount)."""
    sizes = {"hidden_dim": config.hidden_dim, "num_layers": config.num_layers}
    actor = make_noise_actor(
        policy,
        noise_spec,
        noise_bound=config.noise_bound,
        zero_mean_init=config.zero_mean_init,
        **sizes,
    )
    critic = make_noise_critic(policy, **sizes)
    target = target_entropy_per_dim(config.noise_bound, config.target_entropy_per_dim)
    loss_module = SACLoss(
        actor,
        critic,
        num_qvalue_nets=2,
        loss_function="l2",
        alpha_init=config.alpha_init,
        action_spec=noise_spec,
        target_entropy=target * policy.action_shape.numel(),
    )
    loss_module.make_value_estimator(gamma=decision_discount(config.gamma, executed_chunk_length))
    target_updater = SoftUpdate(loss_module, tau=config.tau)
    actor_optimizer = torch.optim.Adam(
        loss_module.actor_network_params.values(True, True), lr=config.actor_learning_rate
    )
    critic_optimizer = torch.optim.Adam(
        loss_module.qvalue_network_params.values(True, True), lr=config.critic_learning_rate
    )
    alpha_optimizer = torch.optim.Adam([loss_module.log_alpha], lr=config.alpha_learning_rate)
    optimizers = (actor_optimizer, critic_optimizer, alpha_optimizer)
    return actor, Learner(loss_module, target_updater, *optimizers)


# ----------------------------------------------------------------------------- the updates
def dsrl_iteration(
    batch: TensorDictBase,
    learner: Learner,
    replay_buffer: ReplayBuffer,
    run: Progress,
    window: MetricWindow,
    config: DSRLConfig,
    executed_chunk_length: int,
) -> None:
    """Count and record a collected batch, store it, then make the updates it pays for.

    ``utd_ratio`` updates per collected decision (the fraction carried over in
    ``run.update_credit``), once the buffer holds the uniform-noise warm-up.
    """
    new_env_steps = collectors.env_steps(batch)
    run.iteration += 1
    run.env_steps += new_env_steps
    window.env_steps += new_env_steps
    for name, value in episodes.batch_statistics(batch).items():  # success, chunk reward
        window.add(name, value)
    window.add("train/noise_abs", batch["action"].abs().mean().item())
    window.add("train/chunk_abs", batch[("next", *DECODED_ACTION_KEY)].abs().mean().item())
    batch["next", "reward"] = batch["next", "reward"] * config.reward_scale
    # The decoded chunks are logged above; the learner never needs them.
    decoded = DECODED_ACTION_KEY[0]
    replay_buffer.extend(batch.exclude(decoded, ("next", decoded)).reshape(-1))

    update_start = time.perf_counter()
    if len(replay_buffer) >= max(
        config.random_env_steps // executed_chunk_length, config.batch_size
    ):
        run.update_credit += config.utd_ratio * batch.numel()
        while run.update_credit >= 1.0:
            run.update_credit -= 1.0
            sac_update(learner, replay_buffer.sample(), run, window, config)
    window.update_seconds += time.perf_counter() - update_start


def sac_update(
    learner: Learner,
    minibatch: TensorDictBase,
    run: Progress,
    window: MetricWindow,
    config: DSRLConfig,
) -> None:
    """One gradient step of SAC (of the critics only during ``critic_warmup_updates``)."""
    losses = learner.loss_module(minibatch)
    if run.updates < config.critic_warmup_updates:
        # The critics learn first: the actor would follow an untrained Q.
        loss, stepped = losses["loss_qvalue"], (learner.critic_optimizer,)
    else:
        loss = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
        stepped = learner.optimizers()
    for optimizer in learner.optimizers():
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    for optimizer in stepped:
        optimizer.step()
    learner.target_updater.step()
    run.updates += 1
    window.updates += 1
    for name in ("loss_actor", "loss_qvalue", "loss_alpha", "alpha", "entropy"):
        window.add(name, losses[name].item())


# ----------------------------------------------------------------------------- collector, checkpoints
def make_replay_buffer(
    config: DSRLConfig, executed_chunk_length: int, device: torch.device | str = "cpu"
) -> ReplayBuffer:
    """Uniform sampling of ``batch_size`` decisions, stored on ``device``; by default it holds
    the whole run."""
    decisions_per_batch = config.num_envs * config.decisions_per_batch
    buffer_size = config.buffer_size or (
        config.total_env_steps // executed_chunk_length + decisions_per_batch
    )
    return ReplayBuffer(
        storage=LazyTensorStorage(buffer_size, device=device),
        sampler=RandomSampler(),
        batch_size=config.batch_size,
    )


def next_multiple(value: int, every: int) -> int:
    """The first multiple of ``every`` above ``value``."""
    return (value // every + 1) * every


# ----------------------------------------------------------------------------- main
def main(config: DSRLConfig) -> dict:
    # Config: checked before any work; seeds, threads, the output folder.
    device = run_settings.check_run_config(config)  # a number out of bounds, an unavailable device
    runs.seed_random_generators(config.seed)
    torch.set_num_threads(config.threads)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # The pretrained policy (made first when missing), frozen from here on; the --resume
    # checkpoint is refused now if it is another run's.
    # The sampler settings the checkpoint saved (its ODE's K replaced when one is given).
    policy, model_config, _, pretrained_state = pretrain.load_or_pretrain(config, None, device)
    if config.eval_num_denoising_steps:
        steps = config.eval_num_denoising_steps
        policy.options = policy.options.replace(eval_num_denoising_steps=steps)
    checkpoint = output_dir / "checkpoint.pt"
    networks = {"hidden_dim": config.hidden_dim, "num_layers": config.num_layers}
    origin = {"seed": config.seed, "pretrained_weights": weights_digest(policy.state_dict())}
    identity = runs.run_identity(config.task, model_config, networks=networks, **origin)
    identity["sampler"] = policy.options.to_dict()  # the frozen policy's decoding
    saved = runs.load_run(checkpoint, identity) if config.resume else None
    executed = model_config.executed_chunk_length
    max_decisions = reports.decisions_per_episode(config.max_episode_steps, executed)

    # Baselines on the curve seeds (BC under both decodings, the expert); the noise envs.
    bc_env = reports.make_eval_env(config, config.eval_episodes, executed, device)
    baselines = reports.curve_baselines(policy, bc_env, max_decisions, config)
    bc_env.close()
    task = get_task(config.task)
    eval_env = make_noise_env(policy, config, task.eval_envs(config.eval_episodes), executed)
    train_env = make_noise_env(policy, config, config.num_envs, executed)

    # Noise actor and SAC learner; a replay buffer that by default holds the whole run;
    # resumed (networks, optimisers, buffer, counters, history) if asked.
    actor, learner = make_learner(policy, train_env.full_action_spec_unbatched, config, executed)
    replay_buffer = make_replay_buffer(config, executed, device)
    run, random_state = Progress(), None
    if saved is not None:
        run, random_state = resume_dsrl_run(saved, learner, replay_buffer)
        del saved  # the stored decisions now live in the replay buffer
        print(f"resumed from iteration {run.iteration} ({run.env_steps} env steps)")

    # Collector (uniform noise until random_env_steps are buffered; its envs seeded for the
    # first batch it collects), logger (a resumed run's CSV files lose the rows logged after
    # its checkpoint, which it logs again); the random streams where the checkpoint left them.
    collector = collectors.make_replay_collector(
        actor,
        train_env,
        decisions_per_batch=config.num_envs * config.decisions_per_batch,
        executed_chunk_length=executed,
        random_env_steps=config.random_env_steps,
        remaining_env_steps=config.total_env_steps - run.env_steps,
        buffered_decisions=len(replay_buffer),
        seed=training_seed(config.seed, run.iteration + 1, config.num_envs),
    )
    experiment = f"dsrl_seed{config.seed}"
    resume_step = run.env_steps if random_state is not None else None
    log = MetricLogger(config.loggers, experiment, output_dir, config, resume_step).log

    def evaluate() -> dict[str, float]:
        """A learning-curve point of the actor's mean noise (decoded by the frozen ODE),
        appended to the run's history with the training wall time, and logged."""
        wall_seconds = time.perf_counter() - training_start
        evaluation = reports.evaluate_on_curve(actor, eval_env, max_decisions, config.eval_episodes)
        row = {"env_steps": run.env_steps, "iteration": run.iteration, "updates": run.updates}
        run.history.append({**row, "wall_seconds": wall_seconds, **evaluation})
        log(
            {f"eval/{name}": evaluation[name] for name in ("success_rate", "mean_return")},
            run.env_steps,
        )
        return evaluation

    if random_state is not None:
        runs.restore_random_state(random_state)

    # Loop (after evaluating the actor's starting point): collect, update, log, evaluate,
    # checkpoint; a resumed run's training clock goes on from its checkpoint's.
    training_start = time.perf_counter() - run.wall_seconds
    next_eval = next_multiple(run.env_steps, config.eval_every_env_steps)
    next_log = next_multiple(run.env_steps, config.log_every_env_steps)
    next_checkpoint = next_multiple(run.env_steps, config.checkpoint_every_env_steps)
    window = MetricWindow()
    bar = tqdm(total=config.total_env_steps, initial=run.env_steps, desc="DSRL env steps")
    if not run.history:
        evaluate()
    collect_start = time.perf_counter()
    for batch in collector:
        window.collect_seconds += time.perf_counter() - collect_start
        env_steps_before = run.env_steps
        dsrl_iteration(batch, learner, replay_buffer, run, window, config, executed)
        if run.env_steps >= next_log:
            next_log += config.log_every_env_steps
            log(window.row(run.updates), run.env_steps)
            window = MetricWindow()
        if run.env_steps >= next_eval:
            next_eval += config.eval_every_env_steps
            bar.set_postfix(success=f"{evaluate()['success_rate']:.0%}")
        if run.env_steps >= next_checkpoint:
            next_checkpoint += config.checkpoint_every_env_steps
            run.wall_seconds = time.perf_counter() - training_start
            save_dsrl_run(checkpoint, learner, replay_buffer, run, identity)
        bar.update(run.env_steps - env_steps_before)
        collect_start = time.perf_counter()
    bar.close()
    collector.shutdown()

    # Evaluation: the final level, the checkpoint, the held-out protocol (BC and DSRL under
    # both decodings, the expert), plot, summary.json.
    if not run.history or run.history[-1]["env_steps"] != run.env_steps:
        evaluate()
    run.wall_seconds = time.perf_counter() - training_start
    save_dsrl_run(checkpoint, learner, replay_buffer, run, identity)
    eval_env.close()
    held_out_envs = task.eval_envs(config.held_out_episodes)
    held_out_env = make_noise_env(policy, config, held_out_envs, executed)
    held_out = reports.held_out_protocol(
        policy, actor, config, executed, held_out_env, name="DSRL", device=device
    )
    held_out_env.close()
    summary = reports.run_summary(
        config,
        baselines,
        run.history,
        held_out,
        pretrained_state,
        bc_noise_free_return=baselines["BC (noise-free)"]["mean_return"],
        updates=run.updates,
        training_wall_seconds=run.wall_seconds,
        wall_seconds=time.perf_counter() - start,
    )
    title = f"{task.title} DSRL: deterministic evaluation (mean noise, ODE K = 20)"
    label = "DSRL (mean noise)"
    reports.write_run_report(
        output_dir, summary, name="DSRL", title=title, label=label, wall_time=True
    )
    return summary


if __name__ == "__main__":
    main(parse_args())
