"""Flow-SDE sampler demo: an action expert drives chunked Pusher-v5 through a TorchRL collector.

A transformer action expert (untrained: no weights are downloaded or shipped) with an
observation encoder is wrapped as a ``FlowSDEPolicy``. A TorchRL ``Collector`` steps a chunked
gymnasium ``Pusher-v5`` with it: each decision samples a chunk of ``H`` actions with the mixed
ODE/SDE sampler, the environment executes the first ``H'`` rows, and the batch stores the
denoising chain and the per-step log-probabilities a PPO learner needs. For every batch the
script prints the chunk log-prob statistics, the largest difference between the stored
log-probs and those the learner recomputes from the stored chains, the return of finished
episodes and the throughput; at the end, how often each denoising step was stochastic, and a
deterministic evaluation episode with the ODE sampler at ``eval_num_steps``.

Run (every option: ``--help``; every printed number: docs/examples/sampler_demo.md)::

    python examples/sampler_demo.py
    python examples/sampler_demo.py --total-decisions 40 --frames-per-batch 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchrl.collectors import Collector
from torchrl.envs import GymEnv, RewardSum, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from tqdm import tqdm

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.envs import make_chunked_env
from torchrl_flowpolicy.flow import sigma_grid, step_coefficients
from torchrl_flowpolicy.networks import ActionExpertTransformer, ObservationEncoder


def option(default, help: str, choices: tuple | None = None):
    """A config field: its default, one line of documentation, optional allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


# ----------------------------------------------------------------------------- configuration
@dataclass
class Config:
    # environment
    env_name: str = option("Pusher-v5", "gymnasium MuJoCo task with a vector observation")
    num_envs: int = option(4, "environments stepped side by side (SerialEnv), batched per call")
    chunk_length: int = option(8, "H: rows of the chunk the action expert predicts")
    executed_chunk_length: int = option(4, "H': rows the environment executes per decision")
    # sampler
    num_steps: int = option(8, "K: denoising steps of a rollout decision")
    eval_num_steps: int = option(20, "K of the deterministic ODE used for evaluation")
    noise_level: float = option(0.5, "a: Flow-SDE noise scale, the exploration knob")
    sde_mode: str = option("mixed", "which steps are stochastic", ("mixed", "last", "all"))
    num_sde_steps: int = option(4, "number of stochastic steps for sde_mode=last")
    shift: float = option(1.0, "time shift s of the sigma grid (1.0: uniform)")
    noise_schedule: str = option(
        "sqrt", "g(sigma): a*sqrt(sigma/(1-sigma)) or a", ("sqrt", "constant")
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
    num_threads: int = option(1, "torch CPU threads (1 is fastest for these small networks)")
    device: str = option("cpu", "device of the policy; the environments run on the CPU")
    output_dir: str = option("outputs/sampler_demo", "folder for summary.json")


def parse_config(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Config):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            choices=f.metadata["choices"],
            help=f"{f.metadata['help']} (default: {f.default})",
        )
    return Config(**vars(parser.parse_args(argv)))


def main(cfg: Config) -> dict:
    print("config:", json.dumps(dataclasses.asdict(cfg)))

    # ------------------------------------------------------------------------- seeding
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)

    # ------------------------------------------------------------------------- environments
    def make_env():
        # StepCounter sits inside the chunked env, so it counts environment steps; RewardSum
        # sits outside, so it adds up decision rewards into the episode return.
        base = TransformedEnv(GymEnv(cfg.env_name), StepCounter())
        return TransformedEnv(make_chunked_env(base, cfg.executed_chunk_length), RewardSum())

    env = SerialEnv(cfg.num_envs, make_env)
    env.set_seed(cfg.seed)
    observation_dim = env.observation_spec["observation"].shape[-1]
    action_dim = env.action_spec.shape[-1]
    action_shape = (cfg.chunk_length, action_dim)

    # ------------------------------------------------------------------------- policy
    encoder = ObservationEncoder(
        observation_dim, model_dim=cfg.model_dim, num_tokens=cfg.num_context_tokens
    )
    expert = ActionExpertTransformer(
        action_shape, model_dim=cfg.model_dim, num_heads=cfg.num_heads, num_layers=cfg.num_layers
    )
    policy = FlowSDEPolicy(
        expert,
        action_shape=action_shape,
        encoder=encoder,
        num_steps=cfg.num_steps,
        eval_num_steps=cfg.eval_num_steps,
        noise_level=cfg.noise_level,
        sde_mode=cfg.sde_mode,
        num_sde_steps=cfg.num_sde_steps,
        shift=cfg.shift,
        noise_schedule=cfg.noise_schedule,
        executed_chunk_length=cfg.executed_chunk_length,
    ).to(cfg.device)
    num_parameters = sum(p.numel() for p in policy.parameters())
    print(
        f"policy: {num_parameters:,} parameters, action chunk {action_shape} "
        f"(executes {cfg.executed_chunk_length} rows), observation {observation_dim} features"
    )

    # ------------------------------------------------------------------------- collector
    collector = Collector(
        env,
        policy,
        frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.total_decisions,
        policy_device=cfg.device,
        env_device="cpu",
        storing_device=cfg.device,
        auto_register_policy_transforms=False,  # the policy keeps no recurrent state
    )

    # ------------------------------------------------------------------------- collection loop
    step_counts = torch.zeros(cfg.num_steps, dtype=torch.long)
    step_log_prob_sums = torch.zeros(cfg.num_steps, dtype=torch.float64)
    totals = {"decisions": 0, "env_steps": 0, "collect_s": 0.0, "recompute_s": 0.0}
    all_log_probs, episode_returns, batches = [], [], []
    max_mismatch = 0.0
    progress = tqdm(total=cfg.total_decisions, unit="decision", dynamic_ncols=True)
    tick = time.perf_counter()
    for index, batch in enumerate(collector):
        collect_s = time.perf_counter() - tick
        decisions = batch.numel()
        env_steps = int((batch["next", "step_count"] - batch["step_count"]).sum())

        # The chunk log-prob: a sum over the stochastic steps and the H' x D executed entries.
        log_prob = batch["action_log_prob"].flatten().double().cpu()
        all_log_probs.append(log_prob)
        sde_mask = batch["flow", "sde_mask"].reshape(-1, cfg.num_steps).cpu()
        step_counts += sde_mask.sum(0)
        step_log_prob_sums += batch["flow", "step_log_prob"].reshape(-1, cfg.num_steps).sum(0).cpu()

        # What a learner would do with this batch: recompute every stored step's log-prob
        # from the stored chain, in one batched network call, and compare.
        start = time.perf_counter()
        with torch.no_grad():
            recomputed = policy.log_prob(batch)
        recompute_s = time.perf_counter() - start
        mismatch = float((recomputed - batch["flow", "step_log_prob"]).abs().max())
        max_mismatch = max(max_mismatch, mismatch)

        done = batch["next", "done"].squeeze(-1)
        finished = batch["next", "episode_reward"].squeeze(-1)[done].double().cpu()
        episode_returns += finished.tolist()

        totals["decisions"] += decisions
        totals["env_steps"] += env_steps
        totals["collect_s"] += collect_s
        totals["recompute_s"] += recompute_s
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
        batches.append(record)
        episodes = (
            f"{len(finished)} episodes, return {finished.mean():8.2f}" if len(finished) else ""
        )
        tqdm.write(
            f"batch {index:3d} | {decisions} decisions, {env_steps} env steps | log-prob "
            f"mean {record['log_prob_mean']:7.2f} std {record['log_prob_std']:6.2f} "
            f"[{record['log_prob_min']:7.2f}, {record['log_prob_max']:7.2f}] | recompute "
            f"|diff| {mismatch:.1e} | {record['decisions_per_s']:6.1f} decisions/s, "
            f"{record['env_steps_per_s']:7.1f} env steps/s | {episodes}"
        )
        progress.update(decisions)
        tick = time.perf_counter()
    progress.close()
    collector.shutdown()
    # Closing the environments hands their threads back to torch's pool: restore the setting.
    torch.set_num_threads(cfg.num_threads)

    # ------------------------------------------------------------------------- report
    log_probs = torch.cat(all_log_probs)
    decisions_per_s = totals["decisions"] / totals["collect_s"]
    env_steps_per_s = totals["env_steps"] / totals["collect_s"]
    print(
        f"\ncollected {totals['decisions']} decisions ({totals['env_steps']} env steps) in "
        f"{totals['collect_s']:.1f} s: {decisions_per_s:.1f} decisions/s, "
        f"{env_steps_per_s:.1f} env steps/s; log-prob recompute {totals['recompute_s']:.2f} s "
        f"in total, max |stored - recomputed| = {max_mismatch:.2e}"
    )
    print(
        f"chunk log-prob over all decisions: mean {log_probs.mean():.2f}, std "
        f"{log_probs.std():.2f}, min {log_probs.min():.2f}, max {log_probs.max():.2f}"
    )

    sigmas = sigma_grid(cfg.num_steps, cfg.shift, dtype=torch.float64)
    step_std = step_coefficients(sigmas, cfg.noise_level, cfg.noise_schedule)[2]
    print(f"\nstochastic steps (sde_mode={cfg.sde_mode}, K={cfg.num_steps}):")
    print("   k  sigma_k   std_k    count   share  mean step log-prob")
    largest = max(int(step_counts.max()), 1)
    histogram = []
    for k in range(cfg.num_steps):
        count = int(step_counts[k])
        share = count / max(totals["decisions"], 1)
        mean_lp = f"{step_log_prob_sums[k].item() / count:9.2f}" if count else f"{'-':>9}"
        # Step 0 (sigma = 1) is never stochastic: its std is not used.
        std = f"{step_std[k]:6.3f}" if k > 0 else f"{'-':>6}"
        bar = "#" * round(30 * count / largest)
        print(f"  {k:2d}  {sigmas[k]:7.3f}  {std}  {count:7d}  {share:6.1%}  {mean_lp}  {bar}")
        histogram.append(
            {"k": k, "sigma": sigmas[k].item(), "std": step_std[k].item(), "count": count}
        )
    returns = torch.tensor(episode_returns, dtype=torch.float64)
    if len(returns):
        print(f"finished episodes: {len(returns)}, mean return {returns.mean():.2f}")

    # ------------------------------------------------------------------------- evaluation
    eval_env = make_env()
    eval_env.set_seed(cfg.seed + 1)
    start = time.perf_counter()
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        rollout = eval_env.rollout(cfg.eval_max_decisions, policy)
    eval_s = time.perf_counter() - start
    evaluation = {
        "num_steps": cfg.eval_num_steps,
        "decisions": rollout.numel(),
        "env_steps": int(rollout["next", "step_count"][-1]),
        "return": rollout["next", "reward"].sum().item(),
        "done": bool(rollout["next", "done"][-1]),
        "seconds": eval_s,
        "decisions_per_s": rollout.numel() / eval_s,
    }
    print(
        f"\nevaluation (deterministic ODE, K={cfg.eval_num_steps}): return "
        f"{evaluation['return']:.2f} over {evaluation['env_steps']} env steps "
        f"({evaluation['decisions']} decisions, episode done: {evaluation['done']}), "
        f"{eval_s:.2f} s, {evaluation['decisions_per_s']:.1f} decisions/s"
    )
    eval_env.close()

    # ------------------------------------------------------------------------- save
    summary = {
        "config": dataclasses.asdict(cfg),
        "num_parameters": num_parameters,
        "decisions": totals["decisions"],
        "env_steps": totals["env_steps"],
        "collect_seconds": totals["collect_s"],
        "recompute_seconds": totals["recompute_s"],
        "decisions_per_s": decisions_per_s,
        "env_steps_per_s": env_steps_per_s,
        "log_prob": {
            "mean": log_probs.mean().item(),
            "std": log_probs.std().item() if len(log_probs) > 1 else 0.0,
            "min": log_probs.min().item(),
            "max": log_probs.max().item(),
        },
        "recompute_max_abs_diff": max_mismatch,
        "stochastic_step_histogram": histogram,
        "episode_returns": episode_returns,
        "evaluation": evaluation,
        "batches": batches,
    }
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "summary.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(summary, indent=2))
    temporary.replace(path)
    print(f"summary written to {path}")
    return summary


if __name__ == "__main__":
    main(parse_config())
