"""Collection throughput: env steps/s with 1 and with 2 collector processes.

One process: TorchRL's ``Collector`` stepping ``num_envs`` chunked task environments and
the flow policy (K = 8, the examples' reference transformer, RANDOM exploration) in this
process. Two processes: TorchRL's ``MultiSyncCollector`` with 2 workers of ``num_envs / 2``
environments each (the examples' ``--collector_workers 2``), the policy's weights in shared
memory. Rounds alternate the two (the order rotates), each round timing ``batches`` batches
after one warm-up batch; the ratio is the median of the per-round ratios. Env steps are
counted exactly (TorchRL's ``StepCounter``), so early termination (Lift) is accounted for.

Run ``python benchmarks/bench_collectors.py --task lift`` (or ``--task pusher``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.envs.utils import ExplorationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from torchrl_flowpolicy.envs import TASKS, get_task  # noqa: E402
from torchrl_flowpolicy.networks import ObservationNormalizer  # noqa: E402
from torchrl_flowpolicy.sampler import SamplerOptions  # noqa: E402

from common import (  # noqa: E402
    ModelConfig,
    build_policy,
    decisions_per_episode,
    env_steps,
    make_task_env,
)


def make_env(config: SimpleNamespace, num_envs: int, seed: int):
    env = make_task_env(config, num_envs, 4, count_steps=True)
    env.set_seed(seed)
    return env


def make_collector(config: SimpleNamespace, policy, workers: int, frames: int):
    options = {
        "frames_per_batch": frames,
        "total_frames": -1,
        "exploration_type": ExplorationType.RANDOM,
        "auto_register_policy_transforms": False,
    }
    if workers == 1:
        return Collector(make_env(config, config.num_envs, 0), policy, **options)
    per_worker = config.num_envs // workers
    factories = [
        functools.partial(make_env, config, per_worker, index * per_worker)
        for index in range(workers)
    ]
    return MultiSyncCollector(
        factories, policy, cat_results=0, num_threads=1, num_sub_threads=1, **options
    )


def time_collector(collector, batches: int) -> float:
    """Env steps per second over ``batches`` batches, after one warm-up batch."""
    iterator = iter(collector)
    next(iterator)
    start, steps = time.perf_counter(), 0
    for _ in range(batches):
        steps += env_steps(next(iterator))
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="pusher", choices=sorted(TASKS))
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 batches")
    parser.add_argument("--output", default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batches = 2, 2
    torch.set_num_threads(1)
    task = get_task(args.task)
    config = SimpleNamespace(task=args.task, num_envs=args.num_envs, **task.defaults)
    model = ModelConfig(observation_dim=task.observation_dim, action_dim=task.action_dim)
    normalizer = ObservationNormalizer(
        torch.zeros(task.observation_dim), torch.ones(task.observation_dim)
    )
    policy = build_policy(
        model,
        normalizer,
        options=SamplerOptions(num_denoising_steps=8, sde_mode="last", num_sde_steps=4),
    )
    frames = args.num_envs * decisions_per_episode(config.max_episode_steps, 4)
    rates: dict[int, list[float]] = {1: [], 2: []}
    for round_index in range(args.rounds):
        order = (1, 2) if round_index % 2 == 0 else (2, 1)
        for workers in order:
            collector = make_collector(config, policy, workers, frames)
            try:
                rates[workers].append(time_collector(collector, args.batches))
            finally:
                collector.shutdown()
        print(
            f"round {round_index}: "
            + ", ".join(f"{w} process(es) {rates[w][-1]:.0f} steps/s" for w in (1, 2))
        )
    ratios = [two / one for one, two in zip(rates[1], rates[2], strict=True)]
    result = {
        "task": args.task,
        "num_envs": args.num_envs,
        "steps_per_second": {str(w): statistics.median(v) for w, v in rates.items()},
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    print(
        f"{args.task}: 1 process {result['steps_per_second']['1']:.0f} env steps/s, "
        f"2 processes {result['steps_per_second']['2']:.0f}: ratio {result['ratio_median']:.2f} "
        f"({result['ratio_min']:.2f}-{result['ratio_max']:.2f}, {args.rounds} rounds)"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
