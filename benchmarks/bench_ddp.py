"""Learner throughput of data-parallel PPO: samples/s with 1 and 2 processes.

What it measures: ``examples/ppo.py``'s learner, ``ppo_iteration`` (reward scaling, success
flags, GAE, then ``epochs`` passes of minibatch updates of ``DenoisingClipPPOLoss``: critic
and actor losses, one backward, :func:`~torchrl_flowpolicy.training.distributed.average_gradients`,
clipping, two Adam steps), with the example's defaults: the reference transformer policy of
``examples/common.py`` (``build_policy``, default ``ModelConfig``: chunk 8 x 7, width 64, 2
layers; K = 8, the last 4 steps stochastic), 16 environments x 38 decisions = 608 decisions
per process and iteration, 4 epochs of minibatches of 304, self-imitation on. The batch is
synthetic (decisions sampled by the policy from random observations, random rewards, 30 %
of the episodes successful): no environment runs.

Each configuration runs in fresh processes started with ``torch.multiprocessing.spawn`` and
joined in a gloo process group (``init_distributed``), one per process count and thread
count:

* ``1 x 1``: one process, one torch thread (the example's default);
* ``2 x 1``: two data-parallel processes, one thread each; each process updates on its own
  608 decisions, the gradients are averaged after every backward pass;
* ``1 x 2`` (with ``--two-threads``): one process, two torch threads (the other way to use a
  second core).

Samples/s = processes x decisions x epochs / seconds per iteration (the slowest rank's).
The configurations are interleaved in a rotating order for several rounds; the table reports
median per-iteration times, median samples/s, the medians of the per-round ratios to ``1 x 1``
with their interquartile range, and the time spent in ``average_gradients`` per update.
The ideal ``2 x 1`` ratio is 2 on two idle cores; on a busy machine, or with fewer cores than
processes, it shows the overhead (the all-reduce, and two processes sharing the cores). The
all-reduce time includes waiting for the slower rank.

Run::

    python benchmarks/bench_ddp.py             # full run (a few minutes)
    python benchmarks/bench_ddp.py --quick     # smoke run (about a minute)
    python benchmarks/bench_ddp.py --two-threads --rounds 8 --output ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
import torchrl
from example_scripts import load_example
from tensordict import TensorDict, TensorDictBase
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.training import distributed
from torchrl_flowpolicy.training.distributed import close_distributed, init_distributed
from torchrl_flowpolicy.training.models import ModelConfig, build_policy
from torchrl_flowpolicy.training.reports import decisions_per_episode
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option
from torchrl_flowpolicy.training.runs import write_json

ppo = load_example("ppo")  # the example's own learner is what is timed

NUM_ENVS = 16
SUCCESS_FRACTION = 0.3
BASELINE = (1, 1)  # (processes, threads per process)
DATA_PARALLEL = (2, 1)
TWO_THREADS = (1, 2)


@dataclass
class Row:
    """One line of the result table."""

    processes: int
    threads: int
    iteration_seconds: float
    samples_per_second: float
    ratio: float
    ratio_q25: float
    ratio_q75: float
    all_reduce_ms_per_update: float
    rounds: int
    iterations_per_round: int


def synthetic_batch(policy, decisions: int, observation_dim: int) -> TensorDictBase:
    """``[NUM_ENVS, decisions]`` decisions sampled by ``policy`` from random observations,
    with what ``ppo_iteration`` reads: next observations, rewards, done at the last
    decision, success for ``SUCCESS_FRACTION`` of the episodes."""
    shape = (NUM_ENVS, decisions)
    observation = torch.randn(*shape, observation_dim)
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        batch = policy(TensorDict({"observation": observation}, batch_size=shape))
    done = torch.zeros(*shape, 1, dtype=torch.bool)
    done[:, -1] = True
    success = done & (torch.rand(NUM_ENVS, 1, 1) < SUCCESS_FRACTION)
    batch["next"] = TensorDict(
        {
            "observation": torch.randn(*shape, observation_dim),
            "reward": torch.randn(*shape, 1),
            "done": done,
            "terminated": done.clone(),
            "success": success,
        },
        batch_size=shape,
    )
    return batch


def run_rank(
    rank: int, world_size: int, threads: int, port: int, iterations: int, quick: bool, output: str
) -> None:
    """One process of a configuration: warm up, then time ``iterations`` learner iterations;
    rank 0 writes the slowest rank's seconds per iteration and the all-reduce time."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(threads)
    init_distributed(backend="gloo")
    torch.manual_seed(rank)
    config = ppo.PPOConfig()
    if quick:
        config.epochs = 2
    model_config = ModelConfig()
    normalizer = ObservationNormalizer(
        torch.zeros(model_config.observation_dim), torch.ones(model_config.observation_dim)
    )
    policy = build_policy(model_config, normalizer, config.sampler)
    executed = model_config.executed_chunk_length
    learner = ppo.make_learner(policy, config, executed)
    decisions = decisions_per_episode(config.max_episode_steps, executed)
    batch = synthetic_batch(policy, decisions, model_config.observation_dim)
    replay_buffer = ReplayBuffer(
        storage=LazyTensorStorage(NUM_ENVS * decisions),
        sampler=SamplerWithoutReplacement(),
        batch_size=config.minibatch_size,
    )

    # Time the all-reduce inside the learner (ppo_iteration calls distributed.average_gradients).
    average_gradients = distributed.average_gradients
    all_reduce_seconds: list[float] = []

    def timed_average_gradients(parameters) -> None:
        start = time.perf_counter()
        average_gradients(parameters)
        all_reduce_seconds.append(time.perf_counter() - start)

    distributed.average_gradients = timed_average_gradients
    ppo.ppo_iteration(learner, batch.clone(), replay_buffer, config, train_actor=True)  # warm-up
    all_reduce_seconds.clear()
    elapsed = 0.0
    for _ in range(iterations):
        data = batch.clone()
        if world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        ppo.ppo_iteration(learner, data, replay_buffer, config, train_actor=True)
        elapsed += time.perf_counter() - start
    seconds = torch.tensor([elapsed / iterations], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        samples = world_size * NUM_ENVS * decisions * config.epochs
        result = {
            "seconds": seconds.item(),
            "samples": samples,
            "all_reduce_ms": 1e3 * statistics.mean(all_reduce_seconds),
        }
        Path(output).write_text(json.dumps(result))
    close_distributed()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_configuration(processes: int, threads: int, iterations: int, quick: bool) -> dict:
    """Fresh processes for one configuration; what its rank 0 measured."""
    with tempfile.TemporaryDirectory() as folder:
        output = str(Path(folder) / "result.json")
        multiprocessing.spawn(
            run_rank,
            args=(processes, threads, free_port(), iterations, quick, output),
            nprocs=processes,
        )
        return json.loads(Path(output).read_text())


def measure(
    configurations: list[tuple[int, int]], rounds: int, iterations: int, quick: bool
) -> list[Row]:
    """The configurations interleaved, in a rotating order, for ``rounds`` rounds; ratios to
    the first one."""
    results: dict[tuple[int, int], list[dict]] = {key: [] for key in configurations}
    for index in range(rounds):
        shift = index % len(configurations)
        for key in configurations[shift:] + configurations[:shift]:
            result = run_configuration(*key, iterations, quick)
            results[key].append(result)
            print(
                f"  round {index + 1}: {key[0]} x {key[1]}: {result['seconds']:.3f} s/iteration",
                flush=True,
            )

    def samples_per_second(result: dict) -> float:
        return result["samples"] / result["seconds"]

    baseline = [samples_per_second(result) for result in results[configurations[0]]]
    rows = []
    for (processes, threads), runs in results.items():
        ratios = [samples_per_second(run) / base for run, base in zip(runs, baseline, strict=True)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        rows.append(
            Row(
                processes=processes,
                threads=threads,
                iteration_seconds=statistics.median(run["seconds"] for run in runs),
                samples_per_second=statistics.median(samples_per_second(run) for run in runs),
                ratio=statistics.median(ratios),
                ratio_q25=quartiles[0],
                ratio_q75=quartiles[2],
                all_reduce_ms_per_update=statistics.median(run["all_reduce_ms"] for run in runs),
                rounds=rounds,
                iterations_per_round=iterations,
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'processes x threads':>19} {'s/iteration':>11} {'samples/s':>10} "
        f"{'ratio to 1 x 1':>14} {'(q25-q75)':>13} {'all-reduce ms/update':>20}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{f'{row.processes} x {row.threads}':>19} {row.iteration_seconds:>11.3f} "
            f"{row.samples_per_second:>10.0f} {row.ratio:>14.3f} "
            f"{f'({row.ratio_q25:.3f}-{row.ratio_q75:.3f})':>13} "
            f"{row.all_reduce_ms_per_update:>20.3f}"
        )
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (2 epochs)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument(
        "--iterations", type=int, default=None, help="learner iterations timed per round"
    )
    parser.add_argument(
        "--two-threads", action="store_true", help="also time one process with two threads"
    )
    add_output_options(parser)
    arguments = parser.parse_args(argv)
    check_output_option(parser, arguments)
    return arguments


def main(argv: list[str] | None = None) -> list[Row]:
    arguments = parse_arguments(argv)
    rounds = arguments.rounds or (2 if arguments.quick else 5)
    iterations = arguments.iterations or (1 if arguments.quick else 2)
    config = ppo.PPOConfig()
    decisions = decisions_per_episode(config.max_episode_steps, ModelConfig().executed_chunk_length)
    print(
        f"torch {torch.__version__}, torchrl {torchrl.__version__}, {os.cpu_count()} CPUs, "
        f"{NUM_ENVS} x {decisions} decisions per process and iteration, minibatch "
        f"{config.minibatch_size}; {rounds} interleaved rounds x {iterations} iterations "
        f"per configuration",
        flush=True,
    )
    configurations = [BASELINE, DATA_PARALLEL] + ([TWO_THREADS] if arguments.two_threads else [])
    rows = measure(configurations, rounds, iterations, arguments.quick)
    print()
    print(format_table(rows))
    if arguments.output:
        payload = {
            "benchmark": "ddp",
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "quick": arguments.quick,
            "rows": [asdict(row) for row in rows],
        }
        write_json(arguments.output, payload)
        print(f"wrote {arguments.output}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
