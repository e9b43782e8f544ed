"""Flow-SDE sampler demo: an action expert drives chunked Pusher-v5 through a TorchRL collector.

A transformer action expert (untrained: no weights are downloaded or shipped) with an
observation encoder is wrapped as a ``FlowSDEPolicy``. A TorchRL ``Collector`` steps a chunked
gymnasium ``Pusher-v5`` with it: each decision samples a chunk of ``H`` actions with the mixed
ODE/SDE sampler, the environment executes the first ``H'`` rows, and the batch stores the
denoising chain and the per-step log-probabilities a PPO learner needs. For every batch the
script prints the chunk log-prob statistics, the largest difference between the stored
log-probs and those the learner recomputes from the stored chains, the return of finished
episodes and the throughput; at the end, how often each denoising step was stochastic, and a
deterministic evaluation episode with the ODE sampler at ``eval_num_denoising_steps``.

Run (every option: ``--help``; every printed number: docs/examples/sampler_demo.md)::

    python examples/sampler_demo.py
    python examples/sampler_demo.py --total_decisions 40 --frames_per_batch 20
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tensordict import TensorDictBase
from torchrl.collectors import Collector
from torchrl.envs import (
    Compose,
    EnvBase,
    GymEnv,
    RewardSum,
    SerialEnv,
    StepCounter,
    TransformedEnv,
)
from torchrl.envs.utils import ExplorationType, set_exploration_type
from tqdm import tqdm

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.envs import make_chunked_env
from torchrl_flowpolicy.flow import sigma_grid, step_coefficients
from torchrl_flowpolicy.networks import ActionExpertTransformer, ObservationEncoder
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.checkpoint import atomic_write
from torchrl_flowpolicy.training.run_checks import check_output_dir

from common import option, parse_config


@dataclass
class SamplerDemoConfig:
    """Sampler-demo settings; every field is a command-line option."""

    # environment
    env_name: str = option("Pusher-v5", "gymnasium MuJoCo task with a vector observation")
    num_envs: int = option(4, "environments stepped side by side (SerialEnv), batched per call")
    chunk_length: int = option(8, "H: rows of the chunk the action expert predicts")
    executed_chunk_length: int = option(4, "H': rows the environment executes per decision")
    # sampler
    num_denoising_steps: int = option(8, "K: denoising steps of a rollout decision")
    eval_num_denoising_steps: int = option(20, "K of the deterministic ODE used for evaluation")
    noise_level: float = option(0.5, "a: Flow-SDE noise scale, the exploration knob")
    sde_mode: Literal["mixed", "last", "all"] = option("mixed", "which steps are stochastic")
    num_sde_steps: int = option(4, "number of stochastic steps for sde_mode=last")
    shift: float = option(1.0, "time shift s of the sigma grid (1.0: uniform)")
    noise_schedule: Literal["sqrt", "constant"] = option(
        "sqrt", "g(sigma): a*sqrt(sigma/(1-sigma)) or a"
    )
    # networks
    model_dim: int = option(64, "token width of the encoder and the action expert")
    num_heads: int = option(4, "attention heads of the action expert")
    num_layers: int = option(2, "decoder layers of the action expert")
    num_context_tokens: int = option(4, "context tokens the encoder makes per observation")
    # collection and evaluation
    frames_per_batch: int = option(200, "decisions per collected batch, all environments together")
    total_decisions: int = option(2000, "decisions to collect in total")
    eval_max_decisions: int = option(25, "cap on the evaluation episode's decisions")
    # run
    seed: int = option(0, "seed of torch and of the environments")
    threads: int = option(1, "torch CPU threads (1 is fastest for these small networks)")
    device: str = option("cpu", "device of the policy; the environments run on the CPU")
    output_dir: str = option("outputs/sampler_demo", "folder for summary.json")
    overwrite: bool = option(False, "replace the summary.json that output_dir holds")


def make_env(config: SamplerDemoConfig) -> EnvBase:
    """One chunked gymnasium env.

    ``StepCounter`` and ``RewardSum`` sit inside the chunked env: they count environment
    steps and add up their rewards into the episode return (a transform appended after the
    chunking is skipped when every sub-env ends mid-chunk; ``docs/chunking.md``).
    """
    base = TransformedEnv(GymEnv(config.env_name), Compose(StepCounter(), RewardSum()))
    return make_chunked_env(base, config.executed_chunk_length)


def make_policy(config: SamplerDemoConfig, observation_dim: int, action_dim: int) -> FlowSDEPolicy:
    """An untrained transformer action expert with an observation encoder."""
    action_shape = (config.chunk_length, action_dim)
    encoder = ObservationEncoder(
        observation_dim, model_dim=config.model_dim, num_tokens=config.num_context_tokens
    )
    expert = ActionExpertTransformer(
        action_shape,
        model_dim=config.model_dim,
        num_heads=config.num_heads,
        num_layers=config.num_layers,
    )
    return FlowSDEPolicy(
        expert,
        action_shape=action_shape,
        encoder=encoder,
        executed_chunk_length=config.executed_chunk_length,
        options=SamplerOptions(
            num_denoising_steps=config.num_denoising_steps,
            eval_num_denoising_steps=config.eval_num_denoising_steps,
            eval_noise_scale=1.0,  # the deterministic ODE from x_0 ~ N(0, I): the model's samples
            noise_level=config.noise_level,
            sde_mode=config.sde_mode,
            num_sde_steps=config.num_sde_steps,
            shift=config.shift,
            noise_schedule=config.noise_schedule,
        ),
    ).to(config.device)


@dataclass
class CollectionStats:
    """What the collection loop accumulates over the batches."""

    num_denoising_steps: int
    decisions: int = 0
    env_steps: int = 0
    collect_s: float = 0.0
    recompute_s: float = 0.0
    max_mismatch: float = 0.0
    log_probs: list[torch.Tensor] = field(default_factory=list)
    episode_returns: list[float] = field(default_factory=list)
    batches: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.step_counts = torch.zeros(self.num_denoising_steps, dtype=torch.long)
        self.step_log_prob_sums = torch.zeros(self.num_denoising_steps, dtype=torch.float64)


def record_batch(
    index: int,
    batch: TensorDictBase,
    policy: FlowSDEPolicy,
    collect_s: float,
    stats: CollectionStats,
) -> None:
    """Add a batch to ``stats``, recompute its log-probs as a learner would, print a line."""
    decisions = batch.numel()
    env_steps = int((batch["next", "step_count"] - batch["step_count"]).sum())

    # The chunk log-prob: a sum over the stochastic steps and the H' x D executed entries.
    log_prob = batch["action_log_prob"].flatten().double().cpu()
    stats.log_probs.append(log_prob)
    sde_mask = batch["flow", "sde_mask"].reshape(-1, stats.num_denoising_steps).cpu()
    stats.step_counts += sde_mask.sum(0)
    step_log_prob = batch["flow", "step_log_prob"]
    stats.step_log_prob_sums += step_log_prob.reshape(-1, stats.num_denoising_steps).sum(0).cpu()

    # What a learner would do with this batch: recompute every stored step's log-prob
    # from the stored chain, in one batched network call, and compare.
    start = time.perf_counter()
    with torch.no_grad():
        recomputed = policy.log_prob(batch)
    recompute_s = time.perf_counter() - start
    mismatch = float((recomputed - step_log_prob).abs().max())
    stats.max_mismatch = max(stats.max_mismatch, mismatch)

    done = batch["next", "done"].squeeze(-1)
    finished = batch["next", "episode_reward"].squeeze(-1)[done].double().cpu()
    stats.episode_returns += finished.tolist()

    stats.decisions += decisions
    stats.env_steps += env_steps
    stats.collect_s += collect_s
    stats.recompute_s += recompute_s
    record = {
        "batch": index,
        "decisions": decisions,
        "env_steps": env_steps,
        "log_prob_mean": log_prob.mean().item(),
        "log_prob_std": log_prob.std().item() if decisions > 1 else 0.0,
        "log_prob_min": log_prob.min().item(),
        "log_prob_max": log_prob.max().item(),
        "recompute_max_abs_diff": mismatch,
        "finished_episodes": len(finished),
        "decisions_per_s": decisions / collect_s,
        "env_steps_per_s": env_steps / collect_s,
    }
    stats.batches.append(record)
    episodes = f"{len(finished)} episodes, return {finished.mean():8.2f}" if len(finished) else ""
    tqdm.write(
        f"batch {index:3d} | {decisions} decisions, {env_steps} env steps | log-prob "
        f"mean {record['log_prob_mean']:7.2f} std {record['log_prob_std']:6.2f} "
        f"[{record['log_prob_min']:7.2f}, {record['log_prob_max']:7.2f}] | recompute "
        f"|diff| {mismatch:.1e} | {record['decisions_per_s']:6.1f} decisions/s, "
        f"{record['env_steps_per_s']:7.1f} env steps/s | {episodes}"
    )


def report(stats: CollectionStats, config: SamplerDemoConfig) -> list[dict]:
    """Print the totals, the log-prob distribution and the stochastic-step histogram."""
    log_probs = torch.cat(stats.log_probs)
    print(
        f"\ncollected {stats.decisions} decisions ({stats.env_steps} env steps) in "
        f"{stats.collect_s:.1f} s: {stats.decisions / stats.collect_s:.1f} decisions/s, "
        f"{stats.env_steps / stats.collect_s:.1f} env steps/s; log-prob recompute "
        f"{stats.recompute_s:.2f} s in total, max |stored - recomputed| = "
        f"{stats.max_mismatch:.2e}"
    )
    print(
        f"chunk log-prob over all decisions: mean {log_probs.mean():.2f}, std "
        f"{log_probs.std():.2f}, min {log_probs.min():.2f}, max {log_probs.max():.2f}"
    )
    sigmas = sigma_grid(config.num_denoising_steps, config.shift, dtype=torch.float64)
    step_std = step_coefficients(sigmas, config.noise_level, config.noise_schedule)[2]
    print(f"\nstochastic steps (sde_mode={config.sde_mode}, K={config.num_denoising_steps}):")
    print("   k  sigma_k   std_k    count   share  mean step log-prob")
    largest = max(int(stats.step_counts.max()), 1)
    histogram = []
    for k in range(config.num_denoising_steps):
        count = int(stats.step_counts[k])
        share = count / max(stats.decisions, 1)
        mean_lp = f"{stats.step_log_prob_sums[k].item() / count:9.2f}" if count else f"{'-':>9}"
        # Step 0 (sigma = 1) is never stochastic: its std is not used.
        std = f"{step_std[k]:6.3f}" if k > 0 else f"{'-':>6}"
        bar = "#" * round(30 * count / largest)
        print(f"  {k:2d}  {sigmas[k]:7.3f}  {std}  {count:7d}  {share:6.1%}  {mean_lp}  {bar}")
        histogram.append(
            {"k": k, "sigma": sigmas[k].item(), "std": step_std[k].item(), "count": count}
        )
    returns = torch.tensor(stats.episode_returns, dtype=torch.float64)
    if len(returns):
        print(f"finished episodes: {len(returns)}, mean return {returns.mean():.2f}")
    return histogram


def evaluate(policy: FlowSDEPolicy, config: SamplerDemoConfig) -> dict:
    """One deterministic episode (the ODE at ``eval_num_denoising_steps``), capped in decisions."""
    eval_env = make_env(config)
    eval_env.set_seed(config.seed + 1)
    start = time.perf_counter()
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        rollout = eval_env.rollout(config.eval_max_decisions, policy)
    eval_s = time.perf_counter() - start
    evaluation = {
        "num_denoising_steps": config.eval_num_denoising_steps,
        "decisions": rollout.numel(),
        "env_steps": int(rollout["next", "step_count"][-1]),
        "return": rollout["next", "reward"].sum().item(),
        "done": bool(rollout["next", "done"][-1]),
        "seconds": eval_s,
        "decisions_per_s": rollout.numel() / eval_s,
    }
    print(
        f"\nevaluation (deterministic ODE, K={config.eval_num_denoising_steps}): return "
        f"{evaluation['return']:.2f} over {evaluation['env_steps']} env steps "
        f"({evaluation['decisions']} decisions, episode done: {evaluation['done']}), "
        f"{eval_s:.2f} s, {evaluation['decisions_per_s']:.1f} decisions/s"
    )
    eval_env.close()
    return evaluation


def main(config: SamplerDemoConfig) -> dict:
    print("config:", json.dumps(dataclasses.asdict(config)))
    # Before any work: never replace another run's summary without --overwrite.
    check_output_dir(
        config.output_dir,
        ("summary.json",),
        resume=False,
        overwrite=config.overwrite,
        resumable=False,
    )
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)

    # Environments and an untrained policy.
    env = SerialEnv(config.num_envs, make_env, create_env_kwargs={"config": config})
    env.set_seed(config.seed)
    observation_dim = env.observation_spec["observation"].shape[-1]
    policy = make_policy(config, observation_dim, env.action_spec.shape[-1])
    num_parameters = sum(p.numel() for p in policy.parameters())
    print(
        f"policy: {num_parameters:,} parameters, action chunk {tuple(policy.action_shape)} "
        f"(executes {config.executed_chunk_length} rows), observation {observation_dim} features"
    )

    # Collection: every batch is recorded, rescored as a learner would, and printed.
    collector = Collector(
        env,
        policy,
        frames_per_batch=config.frames_per_batch,
        total_frames=config.total_decisions,
        policy_device=config.device,
        env_device="cpu",
        storing_device=config.device,
        auto_register_policy_transforms=False,  # the policy keeps no recurrent state
    )
    stats = CollectionStats(config.num_denoising_steps)
    progress = tqdm(total=config.total_decisions, unit="decision", dynamic_ncols=True)
    tick = time.perf_counter()
    for index, batch in enumerate(collector):
        record_batch(index, batch, policy, time.perf_counter() - tick, stats)
        progress.update(batch.numel())
        tick = time.perf_counter()
    progress.close()
    collector.shutdown()
    # Closing the environments hands their threads back to torch's pool: restore the setting.
    torch.set_num_threads(config.threads)

    # Report, evaluation, summary.
    histogram = report(stats, config)
    evaluation = evaluate(policy, config)
    log_probs = torch.cat(stats.log_probs)
    summary = {
        "config": dataclasses.asdict(config),
        "num_parameters": num_parameters,
        "decisions": stats.decisions,
        "env_steps": stats.env_steps,
        "collect_seconds": stats.collect_s,
        "recompute_seconds": stats.recompute_s,
        "decisions_per_s": stats.decisions / stats.collect_s,
        "env_steps_per_s": stats.env_steps / stats.collect_s,
        "log_prob": {
            "mean": log_probs.mean().item(),
            "std": log_probs.std().item() if len(log_probs) > 1 else 0.0,
            "min": log_probs.min().item(),
            "max": log_probs.max().item(),
        },
        "recompute_max_abs_diff": stats.max_mismatch,
        "stochastic_step_histogram": histogram,
        "episode_returns": stats.episode_returns,
        "evaluation": evaluation,
        "batches": stats.batches,
    }
    path = Path(config.output_dir) / "summary.json"
    atomic_write(path, lambda file: file.write(json.dumps(summary, indent=2).encode()))
    print(f"summary written to {path}")
    return summary


if __name__ == "__main__":
    main(parse_config(SamplerDemoConfig, description=__doc__))
