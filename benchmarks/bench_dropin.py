"""Collection speed of the drop-in: ``FlowSDEPolicy`` against TorchRL's stock Gaussian actor.

What it measures: TorchRL's ``Collector`` on HalfCheetah-v5 (one environment, as TorchRL's
reference ``sota-implementations/ppo/ppo_mujoco.py`` runs it) with each policy on the same
environment and the same ``frames_per_batch``:

* ``stock``: the reference script's actor (``utils_mujoco.make_ppo_models_state``): an MLP
  (2 x 64, Tanh), a state-independent scale, ``ProbabilisticActor`` with ``TanhNormal``;
* ``flow``: ``FlowSDEPolicy`` on ``MLPVelocityNetwork`` of the same size (2 x 64 unless
  ``--hidden`` / ``--layers`` say otherwise), ``K = 8`` (mixed ODE/SDE sampler);
* ``flow K=4`` (``--collect-steps``): the same at a smaller ``K``;
* ``flow K=8 compiled`` (with ``--compile``): the ``K = 8`` policy under
  ``Collector(compile_policy=True)`` (inductor; its compilation runs before the timing).

At ``H = 1`` the flow policy is a single-step policy (``action_shape=(6,)``) on the unwrapped
environment; at ``H = 4`` both policies write ``[4, 6]`` chunks for
``make_chunked_env(env, 4, clamp_actions=True)`` (frames are decisions, four environment
steps each). Every environment is ``GymEnv("HalfCheetah-v5")`` + ``DoubleToFloat`` +
``ClampAction`` (the stock actor's actions are already in the box; the clamp is kept so the
environments are identical). The arms are interleaved: every round times ``--batches``
batches of each, in an order that rotates; the ratios are medians of the per-round ratios, so
a load that changes during the run weighs on both sides.

Where the time goes: each policy's forward alone (``policy(td)`` on one observation, under
RANDOM exploration, as the collector calls it), one bare call of each network (the stock
actor's MLP; the velocity network, of which a flow decision needs ``K``), the flow policy at smaller ``K`` and under ``torch.compile``
(``--compile``), and one environment step alone (``env.step_and_maybe_reset`` with in-box
random actions), all interleaved the same way. From them, the "floor ratio": the flow/stock
frames/s the collector would reach if a flow decision cost exactly ``K`` bare network calls,
``t_stock / (t_stock - t_stock_actor + K t_call)`` (``t_stock``: the stock arm's seconds per
frame; ``t_stock_actor``: the stock actor alone).

Run::

    python benchmarks/bench_dropin.py                  # 8 rounds x 2 batches per arm
    python benchmarks/bench_dropin.py --quick          # smoke run
    python benchmarks/bench_dropin.py --compile --output dropin.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torchrl
from tensordict import TensorDictBase
from torchrl.collectors import Collector
from torchrl.envs import Compose, DoubleToFloat, GymEnv, TransformedEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ProbabilisticActor

from torchrl_flowpolicy import FlowSDEPolicy
from torchrl_flowpolicy.envs.chunking import ClampAction, make_chunked_env
from torchrl_flowpolicy.networks import MLPVelocityNetwork
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.gaussian_baseline import make_gaussian_actor
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option
from torchrl_flowpolicy.training.runs import write_json

ENV_NAME = "HalfCheetah-v5"
OBSERVATION_DIM, ACTION_DIM = 17, 6


# ---------------------------------------------------------------------------- set-up
def make_env(chunk: int, seed: int = 0) -> TransformedEnv:
    """HalfCheetah-v5 + DoubleToFloat + ClampAction; chunked when ``chunk > 1``."""
    base = GymEnv(ENV_NAME)
    if chunk == 1:
        env = TransformedEnv(base, Compose(DoubleToFloat(in_keys=["observation"]), ClampAction()))
    else:
        base = TransformedEnv(base, DoubleToFloat(in_keys=["observation"]))
        env = make_chunked_env(base, chunk, clamp_actions=True)
    env.set_seed(seed)
    return env


def make_stock_actor(env: TransformedEnv, hidden: int, layers: int) -> ProbabilisticActor:
    """The reference script's Gaussian actor, for an action of the environment's shape
    (:func:`~torchrl_flowpolicy.training.gaussian_baseline.make_gaussian_actor`)."""
    return make_gaussian_actor(
        OBSERVATION_DIM, env.full_action_spec_unbatched, num_cells=[hidden] * layers
    )


def make_flow_policy(
    chunk: int, num_denoising_steps: int, hidden: int, layers: int
) -> FlowSDEPolicy:
    chunk_shape = (chunk, ACTION_DIM)
    action_shape = (ACTION_DIM,) if chunk == 1 else chunk_shape
    network = MLPVelocityNetwork(OBSERVATION_DIM, chunk_shape, hidden_dim=hidden, num_layers=layers)
    return FlowSDEPolicy(
        network,
        action_shape=action_shape,
        options=SamplerOptions(num_denoising_steps=num_denoising_steps),
    )


def env_steps_of(batch: TensorDictBase) -> int:
    if ("next", "env_steps") in batch.keys(True):
        return int(batch["next", "env_steps"].sum())
    return batch.numel()


def rotate(items: list, index: int) -> list:
    shift = index % len(items)
    return items[shift:] + items[:shift]


def median_and_quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q25, _, q75 = statistics.quantiles(values, n=4)
    return statistics.median(values), q25, q75


# ---------------------------------------------------------------------------- collection
def collection_arms(chunk: int, args: argparse.Namespace) -> dict[str, tuple]:
    """The arms collected at ``H' = chunk``: ``{name: (policy, compile_policy)}``."""
    torch.manual_seed(0)
    spec_env = make_env(chunk)
    stock = make_stock_actor(spec_env, args.hidden, args.layers)
    spec_env.close()
    flow_policy = make_flow_policy(chunk, args.num_denoising_steps, args.hidden, args.layers)
    arms = {"stock": (stock, False), f"flow K={args.num_denoising_steps}": (flow_policy, False)}
    for num_denoising_steps in args.collect_steps:
        policy = make_flow_policy(chunk, num_denoising_steps, args.hidden, args.layers)
        arms[f"flow K={num_denoising_steps}"] = (policy, False)
    if args.compile:
        arms[f"flow K={args.num_denoising_steps} compiled"] = (flow_policy, True)
    return arms


def measure_collection(args: argparse.Namespace) -> dict:
    """Frames/s and env steps/s of each arm at each chunk length, all interleaved in one run.

    Every round times every arm of every chunk length (rotating order), so that the ratios to
    the reference script's own actor (``stock`` at ``H = 1`` on the unwrapped environment,
    ``over_reference_env_steps``) are per-round ratios of the same load, as the ratios to the
    stock actor of the same chunk length (``over_stock_*``).
    """
    arms, collectors, iterators = {}, {}, {}
    for chunk in args.chunks:
        for name, (policy, compile_policy) in collection_arms(chunk, args).items():
            arm = (chunk, name)
            arms[arm] = policy
            collectors[arm] = Collector(
                make_env(chunk),
                policy,
                frames_per_batch=args.env_steps_per_batch // chunk,
                total_frames=-1,
                compile_policy=compile_policy,
                auto_register_policy_transforms=False,
            )
            iterators[arm] = iter(collectors[arm])
            start = time.perf_counter()
            next(iterators[arm])  # warm-up batch (and compilation)
            if compile_policy:
                print(
                    f"H = {chunk}: compile_policy's first batch took "
                    f"{time.perf_counter() - start:.0f} s"
                )
    frames = {arm: [] for arm in arms}
    steps = {arm: [] for arm in arms}
    for round_index in range(args.rounds):
        for arm in rotate(list(arms), round_index):
            start, count, env_steps = time.perf_counter(), 0, 0
            for _ in range(args.batches):
                batch = next(iterators[arm])
                count += batch.numel()
                env_steps += env_steps_of(batch)
            elapsed = time.perf_counter() - start
            frames[arm].append(count / elapsed)
            steps[arm].append(env_steps / elapsed)
    for collector in collectors.values():
        collector.shutdown()
    reference = (1, "stock") if (1, "stock") in arms else None

    def ratios(values: dict, arm: tuple, to: tuple) -> tuple[float, float, float]:
        return median_and_quartiles([a / b for a, b in zip(values[arm], values[to], strict=True)])

    results = {}
    for chunk in args.chunks:
        names = [name for arm_chunk, name in arms if arm_chunk == chunk]
        row = {
            "frames_per_batch": args.env_steps_per_batch // chunk,
            "frames_per_s": {name: statistics.median(frames[chunk, name]) for name in names},
            "env_steps_per_s": {name: statistics.median(steps[chunk, name]) for name in names},
            "over_stock_frames": {},
            "over_stock_env_steps": {},
            "over_reference_env_steps": {},
        }
        for name in names:
            if name != "stock":
                row["over_stock_frames"][name] = ratios(frames, (chunk, name), (chunk, "stock"))
                row["over_stock_env_steps"][name] = ratios(steps, (chunk, name), (chunk, "stock"))
            if reference is not None and (chunk, name) != reference:
                row["over_reference_env_steps"][name] = ratios(steps, (chunk, name), reference)
        results[chunk] = row
    return results


# ---------------------------------------------------------------------------- components
def time_interleaved(
    calls: dict[str, Callable[[], object]], rounds: int, per_round: int
) -> dict[str, float]:
    """Median seconds per call of each callable, interleaved over rounds (rotating order)."""
    times = {name: [] for name in calls}
    for call in calls.values():  # warm-up
        for _ in range(3):
            call()
    for round_index in range(rounds):
        for name in rotate(list(calls), round_index):
            call = calls[name]
            start = time.perf_counter()
            for _ in range(per_round):
                call()
            times[name].append((time.perf_counter() - start) / per_round)
    return {name: statistics.median(values) for name, values in times.items()}


def component_times(chunk: int, args: argparse.Namespace) -> dict[str, float]:
    """Per-call times at one chunk length: policies alone, one network call, one env step."""
    torch.manual_seed(0)
    env = make_env(chunk)
    observation = env.reset()
    stock = make_stock_actor(env, args.hidden, args.layers)
    flows = {
        num_denoising_steps: make_flow_policy(chunk, num_denoising_steps, args.hidden, args.layers)
        for num_denoising_steps in sorted({args.num_denoising_steps, *args.compare_steps})
    }
    network = flows[args.num_denoising_steps].velocity_network
    x = torch.randn(1, chunk, ACTION_DIM)
    sigma, context = torch.rand(1), observation["observation"].reshape(1, -1)
    actions = [env.full_action_spec_unbatched["action"].rand() for _ in range(64)]
    carried = {"td": observation.clone().set("action", actions[0]), "index": 0}

    def env_step() -> None:  # what the collector calls once per frame
        _, carried["td"] = env.step_and_maybe_reset(carried["td"])
        carried["index"] = (carried["index"] + 1) % len(actions)
        carried["td"]["action"] = actions[carried["index"]]

    stock_network = stock[0].module  # the MLP and the scale, without TorchRL's wrappers
    calls = {
        "env step": env_step,
        "stock actor": lambda: stock(observation.copy()),
        "stock network call": lambda: stock_network(context),
        "flow network call": lambda: network(x, sigma, context),
    }
    for num_denoising_steps, policy in flows.items():
        calls[f"flow K={num_denoising_steps}"] = lambda policy=policy: policy(observation.copy())
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        if args.compile:  # what Collector(compile_policy=True) runs; compiles on first call
            compiled = torch.compile(flows[args.num_denoising_steps])
            start = time.perf_counter()
            compiled(observation.copy())
            print(f"H = {chunk}: torch.compile took {time.perf_counter() - start:.0f} s")
            calls[f"flow K={args.num_denoising_steps} compiled"] = lambda: compiled(
                observation.copy()
            )
        times = time_interleaved(calls, args.component_rounds, args.calls)
    env.close()
    return times


def measure_components(args: argparse.Namespace) -> dict:
    return {chunk: component_times(chunk, args) for chunk in args.chunks}


# ---------------------------------------------------------------------------- report
def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def report(collection: dict, components: dict, args: argparse.Namespace) -> dict:
    arms = list(next(iter(collection.values()))["frames_per_s"])
    others = [arm for arm in arms if arm != "stock"]
    lines = ["", "Collection (medians over rounds; ratios: medians of per-round ratios, q25-q75)"]
    header = ["H", "frames/batch"] + [f"{arm} frames/s" for arm in arms]
    header += [f"{arm} / stock" for arm in others] + [
        f"floor ratio (K={args.num_denoising_steps} calls)"
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    summary = {}
    for chunk, row in collection.items():
        fps, times = row["frames_per_s"], components[chunk]
        # A flow frame at its floor: the stock frame without the stock actor, plus K calls.
        t_stock = 1.0 / fps["stock"]
        flow_floor = (
            t_stock - times["stock actor"] + args.num_denoising_steps * times["flow network call"]
        )
        floor_ratio = t_stock / flow_floor
        cells = [str(chunk), str(row["frames_per_batch"])]
        cells += [f"{fps[arm]:.0f}" for arm in arms]
        for arm in others:
            ratio, q25, q75 = row["over_stock_frames"][arm]
            cells.append(f"{ratio:.2f} ({q25:.2f}-{q75:.2f})")
        cells.append(f"{floor_ratio:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
        summary[chunk] = {"floor_ratio": floor_ratio}
    lines += ["", "Env steps/s (ratios: medians of per-round ratios, q25-q75)"]
    header = ["H"] + [f"{arm} env steps/s" for arm in arms] + [f"{arm} / stock" for arm in others]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for chunk, row in collection.items():
        sps = row["env_steps_per_s"]
        cells = [str(chunk)] + [f"{sps[arm]:.0f}" for arm in arms]
        for arm in others:
            ratio, q25, q75 = row["over_stock_env_steps"][arm]
            cells.append(f"{ratio:.2f} ({q25:.2f}-{q75:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    if 1 in collection:
        lines += [
            "",
            "Env steps/s relative to the reference script's actor (stock, H = 1, "
            "unwrapped environment), the same rounds (q25-q75)",
        ]
        lines += ["| H | arm | env steps/s | / reference |", "|---|---|---|---|"]
        for chunk, row in collection.items():
            for arm, (ratio, q25, q75) in row["over_reference_env_steps"].items():
                speed = row["env_steps_per_s"][arm]
                lines.append(
                    f"| {chunk} | {arm} | {speed:.0f} | {ratio:.2f} ({q25:.2f}-{q75:.2f}) |"
                )
    lines += ["", "Where the time goes (ms per call, medians; one observation, one thread)"]
    names = list(next(iter(components.values())))
    lines += ["| H | " + " | ".join(names) + " | collector frame: " + " / ".join(arms) + " |"]
    lines += ["|" + "---|" * (len(names) + 2)]
    for chunk, times in components.items():
        fps = collection[chunk]["frames_per_s"]
        frame = " / ".join(f"{1e3 / fps[arm]:.2f}" for arm in arms)
        cells = " | ".join(f"{1e3 * times[name]:.3f}" for name in names)
        lines.append(f"| {chunk} | {cells} | {frame} |")
    print("\n".join(lines))
    return summary


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4], help="H' values")
    parser.add_argument("--env-steps-per-batch", type=int, default=200)
    parser.add_argument("--batches", type=int, default=2, help="batches per arm per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--num-denoising-steps", type=int, default=8, help="K of the flow policy")
    parser.add_argument(
        "--compare-steps", type=int, nargs="*", default=[2, 4], help="K values timed alone"
    )
    parser.add_argument(
        "--collect-steps", type=int, nargs="*", default=[4], help="K values also collected"
    )
    parser.add_argument("--hidden", type=int, default=64, help="width of both MLPs")
    parser.add_argument("--layers", type=int, default=2, help="hidden layers of both MLPs")
    parser.add_argument("--calls", type=int, default=50, help="calls per component round")
    parser.add_argument("--component-rounds", type=int, default=20)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="add the flow policy under torch.compile / compile_policy (inductor; minutes)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 batch")
    add_output_options(parser, "write the results as JSON")
    args = parser.parse_args(argv)
    check_output_option(parser, args)
    if args.quick:
        args.rounds, args.batches, args.component_rounds, args.calls = 2, 1, 4, 20
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_arguments(argv)
    torch.set_num_threads(args.threads)
    load_before = load_average()
    print(
        f"{ENV_NAME}, {args.env_steps_per_batch} env steps per batch, K = {args.num_denoising_steps}, "
        f"MLPs {args.layers} x {args.hidden}, {args.threads} thread(s), {args.rounds} rounds x "
        f"{args.batches} batches; torch {torch.__version__}, torchrl {torchrl.__version__}, "
        f"{platform.processor() or platform.machine()}, load average {load_before}"
    )
    components = measure_components(args)
    collection = measure_collection(args)
    summary = report(collection, components, args)
    load_after = load_average()
    print(f"load average: {load_before} before, {load_after} after")
    result = {
        "settings": vars(args),
        "load_average": [load_before, load_after],
        "collection": {str(chunk): row for chunk, row in collection.items()},
        "components_seconds": {str(chunk): row for chunk, row in components.items()},
        "floor": {str(chunk): row for chunk, row in summary.items()},
    }
    if args.output:
        write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
