"""Environment throughput: BatchedGymEnv against TorchRL's SerialEnv of GymEnv, side by side.

Both run the chunked Pusher-v5 task the examples use (``PusherTask`` + ``ChunkedAction``,
4 executed rows per decision, 150-step episodes) with random chunks, in this process, one
torch thread. Rounds alternate between the two; the table reports median environment steps
per second and the ratio.

    python benchmarks/bench_envs.py            # 16 environments, 5 rounds
    python benchmarks/bench_envs.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torchrl.envs import SerialEnv, TransformedEnv

from torchrl_flowpolicy.envs import BatchedGymEnv, make_chunked_env
from torchrl_flowpolicy.tasks import PusherTask, make_pusher_env
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option
from torchrl_flowpolicy.training.runs import write_json

CHUNK = 4
HORIZON = 150


def batched(num_envs: int):
    env = BatchedGymEnv("Pusher-v5", num_envs, max_episode_steps=HORIZON)
    return make_chunked_env(TransformedEnv(env, PusherTask()), CHUNK)


def serial(num_envs: int):
    env = SerialEnv(num_envs, make_pusher_env, create_env_kwargs={"max_episode_steps": HORIZON})
    return make_chunked_env(env, CHUNK)


def steps_per_second(env, num_envs: int, decisions: int) -> float:
    env.set_seed(0)
    start = time.perf_counter()
    env.rollout(decisions, break_when_any_done=False)
    return num_envs * decisions * CHUNK / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    add_output_options(parser, "write the results as JSON")
    arguments = parser.parse_args(argv)
    check_output_option(parser, arguments)
    torch.set_num_threads(1)
    rounds = 2 if arguments.quick else arguments.rounds
    decisions = 10 if arguments.quick else HORIZON // CHUNK
    envs = {"BatchedGymEnv": batched(arguments.num_envs), "SerialEnv": serial(arguments.num_envs)}
    rates: dict[str, list[float]] = {name: [] for name in envs}
    for round_index in range(rounds):
        order = list(envs) if round_index % 2 == 0 else list(reversed(envs))
        for name in order:
            rates[name].append(steps_per_second(envs[name], arguments.num_envs, decisions))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["BatchedGymEnv"] / medians["SerialEnv"]
    print(f"{'environment':<15} {'env steps/s (median)':>22}")
    for name, value in medians.items():
        print(f"{name:<15} {value:>22.0f}")
    print(f"ratio BatchedGymEnv / SerialEnv: {ratio:.2f} ({arguments.num_envs} envs)")
    if arguments.output:
        write_json(arguments.output, {"rates": rates, "medians": medians, "ratio": ratio})
    for env in envs.values():
        env.close()


if __name__ == "__main__":
    main()
