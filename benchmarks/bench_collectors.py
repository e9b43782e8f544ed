"""Collection throughput: env steps/s with 1 and with 2 collector processes.

The collectors of :func:`torchrl_flowpolicy.training.collectors.make_collector`, as
``examples/ppo.py`` builds them (every batch one episode per environment from fresh resets).
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
import statistics
import time

import torch

from torchrl_flowpolicy import SamplerOptions
from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.tasks import TASKS, get_task
from torchrl_flowpolicy.training.collectors import (
    CollectorOptions,
    TaskEnvFactory,
    env_steps,
    make_collector,
    shutdown_collector,
)
from torchrl_flowpolicy.training.models import ModelConfig, build_policy
from torchrl_flowpolicy.training.reports import decisions_per_episode
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option
from torchrl_flowpolicy.training.runs import write_json


def time_collector(collector, batches: int) -> float:
    """Env steps per second over ``batches`` batches, after one warm-up batch."""
    iterator = iter(collector)
    next(iterator)
    start, steps = time.perf_counter(), 0
    for _ in range(batches):
        steps += env_steps(next(iterator))
    return steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="pusher", choices=sorted(TASKS))
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 batches")
    add_output_options(parser, "write the results as JSON")
    args = parser.parse_args(argv)
    check_output_option(parser, args)
    if args.quick:
        args.rounds, args.batches = 2, 2
    torch.set_num_threads(1)
    task = get_task(args.task)
    options = {name: task.defaults[name] for name in task.option_names if name in task.defaults}
    make_env = TaskEnvFactory(args.task, 4, options)
    model = ModelConfig(observation_dim=task.observation_dim, action_dim=task.action_dim)
    normalizer = ObservationNormalizer(
        torch.zeros(task.observation_dim), torch.ones(task.observation_dim)
    )
    sampler = SamplerOptions(num_denoising_steps=8, sde_mode="last", num_sde_steps=4)
    policy = build_policy(model, normalizer, sampler)
    frames = args.num_envs * decisions_per_episode(task.max_episode_steps, 4)
    rates: dict[int, list[float]] = {1: [], 2: []}
    for round_index in range(args.rounds):
        order = (1, 2) if round_index % 2 == 0 else (2, 1)
        for workers in order:
            collection = CollectorOptions(num_envs=args.num_envs, workers=workers)
            collector = make_collector(
                policy, make_env, collection, frames_per_batch=frames, seed=0
            )
            try:
                rates[workers].append(time_collector(collector, args.batches))
            finally:
                shutdown_collector(collector, collection, num_threads=1)
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
        write_json(args.output, result)


if __name__ == "__main__":
    main()
