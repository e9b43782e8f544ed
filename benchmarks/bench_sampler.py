"""Sampling overhead of ``FlowSDEPolicy`` against a bare Euler loop on the same network.

What it measures: one rollout decision, ``policy(td)`` under RANDOM exploration (mixed
ODE/SDE sampler, ``K = 8``, ``noise_level = 0.5``), i.e. what a TorchRL collector calls,
against the plainest possible sampler on the same network and batch::

    context = encoder(observation)          # transformer only; once per decision in both
    x = randn(N, H, D)
    for k in range(K):
        x = x + v(x, sigma_k, context) * (sigma_{k+1} - sigma_k)

The policy additionally draws the step noise, samples the stochastic-step mask, keeps the
whole chain, computes the per-step log-probabilities, checks finiteness and writes five
entries into the tensordict. The ratio ``policy / bare`` is the price of all of that.

Networks: ``MLPVelocityNetwork`` (width 1024, 3 hidden layers, observation_dim 23) and the
reference ``ActionExpertTransformer`` + ``ObservationEncoder`` (defaults), both with
``action_shape (8, 7)``; batch sizes 1 and 64. Everything runs under ``torch.no_grad()`` in
float32 on the CPU with ``torch.set_num_threads(1)`` unless ``--threads`` says otherwise.

The two measurements are interleaved (bare, policy, policy, bare, ...) for many rounds; each
round times a few consecutive calls. The table reports the median per-call time of each and
the median of the per-round ratios with their interquartile range and their full range
(min-max), against the goals (<= 1.15 at batch 1, <= 1.10 at batch >= 64); a last line
states the batch-1 ratio alone. Other processes on the machine skew single rounds: read the
median, and the load average printed before and after.

Run::

    python benchmarks/bench_sampler.py                  # full run (a few minutes)
    python benchmarks/bench_sampler.py --quick          # smoke run (seconds)
    python benchmarks/bench_sampler.py --output sampler.json --threads 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torchrl
from tensordict import TensorDict
from torch import Tensor, nn
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option
from torchrl_flowpolicy.training.runs import write_json

from benchmark_networks import ACTION_SHAPE, NETWORKS, OBSERVATION_DIM, build_networks

NUM_DENOISING_STEPS = 8
NOISE_LEVEL = 0.5


@dataclass
class Row:
    """One line of the result table."""

    network: str
    batch_size: int
    bare_ms: float
    policy_ms: float
    ratio: float
    ratio_q25: float
    ratio_q75: float
    ratio_min: float
    ratio_max: float
    goal: float
    passed: bool
    rounds: int
    calls_per_round: int


def goal_for(batch_size: int) -> float:
    """The overhead goal: <= 1.15 for a single decision, <= 1.10 for batches of 64 and more."""
    return 1.15 if batch_size < 64 else 1.10


def make_bare_sampler(
    network: nn.Module, encoder: nn.Module | None, batch_size: int
) -> Callable[[Tensor], Tensor]:
    """A bare Euler sampler ``observation -> x_K`` (the baseline)."""
    sigmas = flow.sigma_grid(NUM_DENOISING_STEPS, 1.0, dtype=torch.float32)
    step_sizes = sigmas[1:] - sigmas[:-1]

    def sample(observation: Tensor) -> Tensor:
        context = observation if encoder is None else encoder(observation)
        x = torch.randn(batch_size, *ACTION_SHAPE)
        for step in range(NUM_DENOISING_STEPS):
            velocity = network(x, sigmas[step].expand(batch_size), context)
            x = x + velocity * step_sizes[step]
        return x

    return sample


def time_calls(
    function: Callable[[int], object],
    calls: int,
    prepare: Callable[[int], object] | None = None,
) -> float:
    """Seconds per call of ``function(i)`` over ``calls`` consecutive calls.

    ``prepare(calls)``, if given, runs before the clock starts (to build the inputs).
    """
    if prepare is not None:
        prepare(calls)
    start = time.perf_counter()
    for index in range(calls):
        function(index)
    return (time.perf_counter() - start) / calls


def measure(name: str, batch_size: int, *, rounds: int, calls_per_round: int, warmup: int) -> Row:
    """Interleaved timing of the bare loop and the policy for one network and batch size."""
    torch.manual_seed(0)
    network, encoder = build_networks(name)
    policy = FlowSDEPolicy(
        network,
        action_shape=ACTION_SHAPE,
        encoder=encoder,
        options=SamplerOptions(
            num_denoising_steps=NUM_DENOISING_STEPS, noise_level=NOISE_LEVEL, sde_mode="mixed"
        ),
    ).eval()  # inference mode, as a collector's policy
    observation = torch.randn(batch_size, OBSERVATION_DIM)
    bare = make_bare_sampler(network, encoder, batch_size)

    def run_bare(index: int) -> None:
        bare(observation)

    # A fresh tensordict per decision, as a collector hands over; built before the clock.
    inputs: list[TensorDict] = []

    def prepare_policy(calls: int) -> None:
        inputs[:] = [
            TensorDict({"observation": observation}, batch_size=[batch_size]) for _ in range(calls)
        ]

    def run_policy(index: int) -> None:
        policy(inputs[index])

    probe = policy(TensorDict({"observation": observation}, batch_size=[batch_size]))
    if probe["flow", "chain"].shape != (batch_size, NUM_DENOISING_STEPS + 1, *ACTION_SHAPE):
        raise RuntimeError("the policy did not run its RANDOM-exploration sampler.")

    time_calls(run_bare, warmup)
    time_calls(run_policy, warmup, prepare_policy)
    bare_times, policy_times, ratios = [], [], []
    for index in range(rounds):
        # Alternate the order (A B, B A, ...) so that drifts in machine load cancel.
        if index % 2 == 0:
            bare_time = time_calls(run_bare, calls_per_round)
            policy_time = time_calls(run_policy, calls_per_round, prepare_policy)
        else:
            policy_time = time_calls(run_policy, calls_per_round, prepare_policy)
            bare_time = time_calls(run_bare, calls_per_round)
        bare_times.append(bare_time)
        policy_times.append(policy_time)
        ratios.append(policy_time / bare_time)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    ratio = statistics.median(ratios)
    goal = goal_for(batch_size)
    return Row(
        network=name,
        batch_size=batch_size,
        bare_ms=1e3 * statistics.median(bare_times),
        policy_ms=1e3 * statistics.median(policy_times),
        ratio=ratio,
        ratio_q25=quartiles[0],
        ratio_q75=quartiles[2],
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        goal=goal,
        passed=ratio <= goal,
        rounds=rounds,
        calls_per_round=calls_per_round,
    )


def format_table(rows: list[Row]) -> str:
    """The result table: times, median ratio with its interquartile and full ranges, goal,
    verdict."""
    header = (
        f"{'network':<12} {'batch':>5} {'bare ms':>9} {'policy ms':>10} {'ratio':>6} "
        f"{'(q25-q75)':>13} {'[min-max]':>13} {'goal':>6}  result"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.network:<12} {row.batch_size:>5} {row.bare_ms:>9.3f} {row.policy_ms:>10.3f} "
            f"{row.ratio:>6.3f} {f'({row.ratio_q25:.3f}-{row.ratio_q75:.3f})':>13} "
            f"{f'[{row.ratio_min:.3f}-{row.ratio_max:.3f}]':>13} "
            f"{row.goal:>6.2f}  {'pass' if row.passed else 'FAIL'}"
        )
    return "\n".join(lines)


def format_batch_one(rows: list[Row]) -> list[str]:
    """One line per network measured at batch 1: the ratio a single rollout decision costs."""
    return [
        f"batch 1, {row.network}: policy(td) / the bare {NUM_DENOISING_STEPS}-step Euler loop = "
        f"{row.ratio:.3f} (median of {row.rounds} interleaved rounds; range {row.ratio_min:.3f}"
        f"-{row.ratio_max:.3f}, q25-q75 {row.ratio_q25:.3f}-{row.ratio_q75:.3f}; goal <= "
        f"{row.goal:.2f})"
        for row in rows
        if row.batch_size == 1
    ]


def _load_average() -> float | None:
    """The one-minute load average (``None`` where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument(
        "--calls-per-round", type=int, default=None, help="consecutive calls timed per round"
    )
    add_output_options(parser)
    arguments = parser.parse_args(argv)
    check_output_option(parser, arguments)
    return arguments


def main(argv: list[str] | None = None) -> list[Row]:
    arguments = parse_arguments(argv)
    torch.set_num_threads(arguments.threads)
    rounds = arguments.rounds or (6 if arguments.quick else 60)
    calls_per_round = arguments.calls_per_round or (2 if arguments.quick else 5)
    warmup = 2 if arguments.quick else 10
    load_before = _load_average()
    print(
        f"torch {torch.__version__}, torchrl {torchrl.__version__}, threads "
        f"{torch.get_num_threads()}, K={NUM_DENOISING_STEPS}, noise_level={NOISE_LEVEL}, mixed; "
        f"{rounds} interleaved rounds x {calls_per_round} calls; "
        f"{os.cpu_count()} CPUs, load average {load_before}"
    )
    rows = []
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        for name in arguments.networks:
            for batch_size in arguments.batch_sizes:
                row = measure(
                    name,
                    batch_size,
                    rounds=rounds,
                    calls_per_round=calls_per_round,
                    warmup=warmup,
                )
                rows.append(row)
                print(format_table([row]).splitlines()[-1], flush=True)
    load_after = _load_average()
    print()
    print(format_table(rows))
    print("\n".join(format_batch_one(rows)))
    print(f"load average before {load_before}, after {load_after} (other processes skew timings)")
    if arguments.output:
        payload = {
            "benchmark": "sampler",
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "num_denoising_steps": NUM_DENOISING_STEPS,
            "noise_level": NOISE_LEVEL,
            "sde_mode": "mixed",
            "action_shape": list(ACTION_SHAPE),
            "quick": arguments.quick,
            "rounds": rounds,
            "calls_per_round": calls_per_round,
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "rows": [asdict(row) for row in rows],
        }
        write_json(arguments.output, payload)
        print(f"wrote {arguments.output}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
