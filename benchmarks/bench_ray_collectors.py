"""Collection throughput of the collectors of ``examples/ppo.py``: process against Ray backends.

Four set-ups of :func:`torchrl_flowpolicy.training.collectors.make_collector` on the chunked Pusher (``num_envs`` environments, the
examples' reference transformer with K = 8 and the last 4 steps stochastic, as
``benchmarks/bench_collectors.py`` builds it): the process backend with 1 worker (TorchRL's
``Collector`` in this process) and 2 (``MultiSyncCollector``), and the Ray backend
(``RayCollector``) with 1 and 2 actors on a local Ray instance of ``--ray_cpus`` CPUs.
Rounds rotate the order of the set-ups; each timing builds the collector, collects one
warm-up batch, then ``--batches`` batches with the weights sent after every batch, as the
example does. Reported: env steps/s (medians over rounds), per-round ratios (medians and
ranges), and the time to build a collector and collect its first batch.

Run ``python benchmarks/bench_ray_collectors.py`` (needs the ``ray`` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from torchrl_flowpolicy import SamplerOptions
from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.training.collectors import (
    CollectorOptions,
    TaskEnvFactory,
    env_steps,
    make_collector,
)
from torchrl_flowpolicy.training.models import ModelConfig, build_policy
from torchrl_flowpolicy.training.reports import decisions_per_episode

ROOT = Path(__file__).resolve().parents[1]

SETUPS = (("process", 1), ("process", 2), ("ray", 1), ("ray", 2))
EXECUTED_CHUNK_LENGTH = 4
PUSHER_HORIZON = 150


def time_setup(policy, backend: str, workers: int, args: argparse.Namespace) -> tuple[float, float]:
    """``(env steps/s, seconds to build the collector and collect its first batch)``."""
    options = CollectorOptions(num_envs=args.num_envs, workers=workers, backend=backend)
    make_env = TaskEnvFactory(
        "pusher", EXECUTED_CHUNK_LENGTH, {"max_episode_steps": PUSHER_HORIZON}
    )
    frames = args.num_envs * decisions_per_episode(PUSHER_HORIZON, EXECUTED_CHUNK_LENGTH)
    weights = TensorDict.from_module(policy)
    start = time.perf_counter()
    collector = make_collector(policy, make_env, options, frames_per_batch=frames, seed=0)
    batches = iter(collector)
    next(batches)
    collector.update_policy_weights_(weights)
    built = time.perf_counter() - start
    start, steps = time.perf_counter(), 0
    for _ in range(args.batches):
        steps += env_steps(next(batches))
        collector.update_policy_weights_(weights)
    rate = steps / (time.perf_counter() - start)
    collector.shutdown()  # Ray itself stays up for the next set-ups
    torch.set_num_threads(1)  # a multi-process collector's shutdown raises the thread count
    return rate, built


def ratio_summary(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_envs", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--ray_cpus", type=int, default=2)
    args = parser.parse_args()

    import ray

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ray.init(
        num_cpus=args.ray_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    sampler = SamplerOptions(num_denoising_steps=8, sde_mode="last", num_sde_steps=4)
    policy = build_policy(
        ModelConfig(), ObservationNormalizer(torch.zeros(23), torch.ones(23)), sampler
    )
    rates: dict[tuple[str, int], list[float]] = {setup: [] for setup in SETUPS}
    build_seconds: dict[tuple[str, int], list[float]] = {setup: [] for setup in SETUPS}
    for round_index in range(args.rounds):
        shift = round_index % len(SETUPS)
        for backend, workers in SETUPS[shift:] + SETUPS[:shift]:
            rate, built = time_setup(policy, backend, workers, args)
            rates[backend, workers].append(rate)
            build_seconds[backend, workers].append(built)
            print(
                f"round {round_index} {backend} x{workers}: {rate:.0f} env steps/s "
                f"(build + first batch {built:.1f} s)",
                flush=True,
            )
    ray.shutdown()

    result = {
        "env_steps_per_second": {
            f"{backend} x{workers}": statistics.median(values)
            for (backend, workers), values in rates.items()
        },
        "build_and_first_batch_seconds": {
            f"{backend} x{workers}": [round(value, 1) for value in values]
            for (backend, workers), values in build_seconds.items()
        },
        "ray_over_process_1_worker": ratio_summary(rates["ray", 1], rates["process", 1]),
        "ray_over_process_2_workers": ratio_summary(rates["ray", 2], rates["process", 2]),
        "ray_2_over_1_actor": ratio_summary(rates["ray", 2], rates["ray", 1]),
        "process_2_over_1": ratio_summary(rates["process", 2], rates["process", 1]),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
