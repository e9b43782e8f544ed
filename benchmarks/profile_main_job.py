"""Where the wall time of the main job (``examples/ppo.py``, Pusher-v5) goes, each part
beside its physical floor, measured side by side in one run.

Parts, with the policy built as the pretrained one (``models.build_policy``, randomly
initialised: the costs do not depend on the weights, and Pusher's episodes have a fixed
length), all with the run's settings (``examples/ppo.py``'s own command line):

* ``env``: the collector's chunked training env stepped through one batch (zero actions,
  ``env.rollout``) vs ``floor``: the raw gymnasium MuJoCo env (``Pusher-v5``, unwrapped)
  stepped as many times;
* ``policy``: one rollout decision of ``FlowSDEPolicy`` (RANDOM, ``K =
  --sampler.num_denoising_steps``) on the ``num_envs`` observations vs the encoder once and
  ``K`` bare velocity-network calls on the same batch: the difference is the sampler's
  bookkeeping;
* ``collection``: one batch of ``collectors.make_collector`` as ``ppo.py`` builds it vs the
  env floor plus ``decisions`` per-decision network floors;
* ``learner``: one ``ppo_iteration`` (actor and critic trained) vs one forward + backward of
  the velocity network per rescored entry (each minibatch's stochastic steps, ``epochs``
  passes);
* ``evaluation``: one ``reports.evaluate_on_curve`` (K = ``eval_num_denoising_steps``) and
  ``protocol``: one ``reports.held_out_protocol`` (BC and PPO under both decodings, the
  expert) vs their network calls (encoder once and ``K`` calls per decision) plus the raw
  env steps of their episodes;
* ``pretrain_step``: one optimiser step of ``examples/pretrain.py``'s flow-matching loop
  (its ``train``, batch ``--pretrain.batch_size``, on a random chunk dataset) vs one forward
  + backward of the network (encoder included) on the same batch.

Every round times every part once, in an order that rotates; the table reports medians
(quartiles) over rounds and the medians of the per-round ratios measured / floor. The run's
totals: ``iterations = ceil(total_env_steps / env steps per batch)`` collections and
learner iterations, one evaluation every ``eval_every`` iterations and at the end, two
more for the BC baselines of the curve (both decodings; the expert's episodes not counted),
the protocol, ``pretrain.train_steps`` pretraining steps (its parity evaluation, the
checkpoints and the logging not counted).

Run (any option of ``examples/ppo.py`` changes the setting profiled)::

    python benchmarks/profile_main_job.py --threads 1 --rounds 3
    python benchmarks/profile_main_job.py --quick --output profile.json
    python benchmarks/profile_main_job.py --sampler.num_denoising_steps 4 --epochs 2
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import gymnasium
import torch
import torchrl
from example_scripts import load_example
from tensordict import TensorDict, TensorDictBase
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy.networks import ObservationNormalizer
from torchrl_flowpolicy.tasks import get_task
from torchrl_flowpolicy.training import collectors, models, reports
from torchrl_flowpolicy.training.data import make_chunk_dataset
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option
from torchrl_flowpolicy.training.runs import write_json

PARTS = ("env", "policy", "collection", "learner", "evaluation", "protocol", "pretrain_step")
PRETRAIN_STEPS_PER_ROUND = 5
# The raw gymnasium environment of a task, the env floor (robosuite's tasks have none here).
RAW_ENVS = {"pusher": "Pusher-v5"}


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def median_and_quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q25, _, q75 = statistics.quantiles(values, n=4)
    return statistics.median(values), q25, q75


def timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


class MainJob:
    """The main job's pieces with its settings, and a timed function for each part and floor.

    Args:
        config: ``examples/ppo.py``'s config (a task of :data:`RAW_ENVS`).
        ppo: the loaded ``examples/ppo.py`` module.
        pretrain: the loaded ``examples/pretrain.py`` module.
    """

    def __init__(self, config, ppo, pretrain):
        self.config, self.ppo, self.pretrain = config, ppo, pretrain
        task = get_task(config.task)
        model_config = dataclasses.replace(
            config.pretrain.model, observation_dim=task.observation_dim, action_dim=task.action_dim
        )
        torch.manual_seed(config.seed)
        normalizer = ObservationNormalizer(
            torch.zeros(task.observation_dim), torch.ones(task.observation_dim)
        )
        self.policy = models.build_policy(model_config, normalizer, config.sampler)
        self.bc_policy = copy.deepcopy(self.policy)
        self.executed = model_config.executed_chunk_length
        self.decisions = reports.decisions_per_episode(config.max_episode_steps, self.executed)
        self.decisions_per_batch = config.num_envs * config.episodes_per_batch * self.decisions
        self.env_steps_per_batch = (
            config.num_envs * config.episodes_per_batch * config.max_episode_steps
        )
        self.make_env = ppo.training_envs(config, self.executed)
        self.options = ppo.collector_options(config)
        self.collector = collectors.make_collector(
            self.policy, self.make_env, self.options, frames_per_batch=self.decisions_per_batch,
            seed=config.seed,
        )  # fmt: skip
        self.batches = iter(self.collector)
        self.learner = ppo.make_learner(self.policy, config, self.executed)
        self.replay_buffer = ppo.make_replay_buffer(config, self.decisions_per_batch)
        self.eval_env = reports.make_eval_env(config, config.eval_episodes, self.executed)
        self.raw_env = gymnasium.make(RAW_ENVS[config.task]).unwrapped
        self.raw_env.reset(seed=config.seed)
        self.batch = self.collect()  # the learner's batch; warms the collector up
        mask = self.batch["flow", "sde_mask"]
        self.stochastic_per_decision = float(mask.sum(-1).float().mean())
        self.observation = self.batch["observation"][0].clone()  # [num_envs, O]
        chain = self.batch["flow", "chain"].reshape(-1, *self.batch["flow", "chain"].shape[2:])
        self.entries = chain[:, 0][mask.reshape(-1, mask.shape[-1]).any(-1)]
        self.pretrain_dataset = self.random_dataset(model_config, task)
        # The pretraining loop's progress bar off; the small parts warmed up.
        pretrain.tqdm = functools.partial(pretrain.tqdm, disable=True)
        for warm_up in (self.decide, self.decide_floor, self.learn_floor, self.pretrain_floor):
            warm_up()

    def random_dataset(self, model_config, task) -> TensorDictBase:
        steps = self.config.pretrain.demo_episodes * self.config.max_episode_steps
        episode = torch.arange(steps) // self.config.max_episode_steps
        observation = torch.randn(steps, task.observation_dim)
        action = torch.rand(steps, task.action_dim) * 2 - 1
        return make_chunk_dataset(observation, action, episode, model_config.chunk_length)

    # ------------------------------------------------------------------ the parts
    def collect(self) -> TensorDictBase:
        collectors.seed_batch(self.collector, self.options, self.config.seed + 1)
        return next(self.batches)

    def step_env(self) -> None:
        env = self.collector.env

        def zero_policy(tensordict: TensorDictBase) -> TensorDictBase:
            action = torch.zeros(*tensordict.batch_size, *self.policy.action_shape)
            return tensordict.set("action", action[..., : self.executed, :])

        for _ in range(self.config.episodes_per_batch):
            env.rollout(self.decisions, zero_policy, break_when_any_done=False)

    def step_raw_env(self) -> None:
        action = self.raw_env.action_space.sample() * 0
        for _ in range(self.env_steps_per_batch // self.config.max_episode_steps):
            self.raw_env.reset()
            for _ in range(self.config.max_episode_steps):
                self.raw_env.step(action)

    def decide(self) -> None:
        """``decisions`` consecutive rollout decisions (the part divides by their number)."""
        observation = TensorDict({"observation": self.observation}, [len(self.observation)])
        with set_exploration_type(ExplorationType.RANDOM):
            for _ in range(self.decisions):
                self.policy(observation.clone(False))

    @torch.no_grad()
    def network_calls(self, observation: torch.Tensor, steps: int) -> None:
        """The encoder once and ``steps`` bare velocity-network calls on the batch."""
        context = self.policy.context(TensorDict({"observation": observation}, [len(observation)]))
        x = torch.randn(len(observation), *self.policy.chunk_shape)
        network = self.policy.velocity_network
        for step in range(steps):
            x = x + 0.1 * network(x, torch.full((len(observation),), step / steps), context)

    def decide_floor(self) -> None:
        for _ in range(self.decisions):
            self.network_calls(self.observation, self.config.sampler.num_denoising_steps)

    def learn(self) -> None:
        self.ppo.ppo_iteration(
            self.learner, self.batch.clone(), self.replay_buffer, self.config, train_actor=True
        )

    def learn_floor(self) -> None:
        """Forward + backward of the velocity network on each minibatch's stochastic entries."""
        network, per_decision = self.policy.velocity_network, self.stochastic_per_decision
        observation = self.batch["observation"].reshape(-1, self.observation.shape[-1])
        for _ in range(self.config.epochs):
            for start in range(0, self.decisions_per_batch, self.config.minibatch_size):
                rows = observation[start : start + self.config.minibatch_size]
                count = max(1, round(len(rows) * per_decision))
                index = torch.arange(count) % len(rows)
                with torch.no_grad():
                    context = self.policy.context(TensorDict({"observation": rows}, [len(rows)]))
                context = context[index] if torch.is_tensor(context) else context
                x = self.entries[torch.arange(count) % len(self.entries)]
                velocity = network(x, torch.rand(count), context)
                self.policy.zero_grad(set_to_none=True)
                velocity.square().mean().backward()

    def evaluate(self) -> None:
        reports.evaluate_on_curve(
            self.policy, self.eval_env, self.decisions, self.config.eval_episodes
        )

    def evaluation_network_floor(self, episodes: int) -> None:
        task = get_task(self.config.task)
        batch = task.eval_envs(episodes)
        for _ in range(math.ceil(episodes / batch)):
            observation = self.observation.new_zeros(batch, self.observation.shape[-1])
            for _ in range(self.decisions):
                self.network_calls(observation, self.config.sampler.eval_num_denoising_steps)

    def raw_episodes(self, episodes: int) -> None:
        action = self.raw_env.action_space.sample() * 0
        for _ in range(episodes):
            self.raw_env.reset()
            for _ in range(self.config.max_episode_steps):
                self.raw_env.step(action)

    def protocol(self) -> None:
        reports.held_out_protocol(self.bc_policy, self.policy, self.config, self.executed)

    def pretrain_steps(self) -> None:
        pretrain_config = dataclasses.replace(
            self.config.pretrain, train_steps=PRETRAIN_STEPS_PER_ROUND
        )
        self.pretrain.train(copy.deepcopy(self.bc_policy), self.pretrain_dataset, pretrain_config)

    def pretrain_floor(self) -> None:
        policy = self.bc_policy
        batch = self.pretrain_dataset[: self.config.pretrain.batch_size]
        size = batch.shape[0]
        context = policy.context(batch)
        velocity = policy.velocity_network(batch["action"], torch.rand(size), context)
        policy.zero_grad(set_to_none=True)
        velocity.square().mean().backward()

    def measure_round(self, index: int) -> dict[str, tuple[float, float]]:
        """``{part: (measured seconds, floor seconds)}`` of one round, parts in rotated order."""
        episodes = self.config.eval_episodes
        held_out = self.config.held_out_episodes
        pieces: dict[str, Callable[[], float]] = {
            "env": lambda: (timed(self.step_env), timed(self.step_raw_env)),
            "policy": lambda: (
                timed(self.decide) / self.decisions,
                timed(self.decide_floor) / self.decisions,
            ),
            "collection": lambda: (timed(self.collect), None),
            "learner": lambda: (timed(self.learn), timed(self.learn_floor)),
            "evaluation": lambda: (
                timed(self.evaluate),
                timed(lambda: self.evaluation_network_floor(episodes))
                + timed(lambda: self.raw_episodes(episodes)),
            ),
            "protocol": lambda: (
                timed(self.protocol),
                4 * timed(lambda: self.evaluation_network_floor(held_out))
                + timed(lambda: self.raw_episodes(5 * held_out)),
            ),
            "pretrain_step": lambda: (
                timed(self.pretrain_steps) / PRETRAIN_STEPS_PER_ROUND,
                timed(self.pretrain_floor),
            ),
        }
        shift = index % len(PARTS)
        result = {part: pieces[part]() for part in PARTS[shift:] + PARTS[:shift]}
        env_floor, decision_floor = result["env"][1], result["policy"][1]
        result["collection"] = (
            result["collection"][0],
            env_floor + self.decisions * decision_floor,
        )
        return result

    def close(self) -> None:
        collectors.shutdown_collector(self.collector, self.options, num_threads=self.config.threads)
        self.eval_env.close()
        self.raw_env.close()


def run_counts(config, job: MainJob) -> dict[str, int]:
    """How many times a whole run does each part."""
    iterations = math.ceil(config.total_env_steps / job.env_steps_per_batch)
    evaluations = iterations // config.eval_every + (iterations % config.eval_every > 0)
    return {
        "env": 0,  # inside the collection
        "policy": 0,
        "collection": iterations,
        "learner": iterations,
        "evaluation": evaluations + 2,  # the BC baselines, both decodings
        "protocol": 1,
        "pretrain_step": config.pretrain.train_steps,
    }


def summarise(rounds: list[dict], counts: dict[str, int]) -> dict:
    parts = {}
    for part in PARTS:
        measured = [row[part][0] for row in rounds]
        floors = [row[part][1] for row in rounds]
        ratios = [m / f for m, f in zip(measured, floors, strict=True)]
        seconds, q25, q75 = median_and_quartiles(measured)
        ratio, ratio_q25, ratio_q75 = median_and_quartiles(ratios)
        parts[part] = {
            "seconds": seconds,
            "seconds_q25": q25,
            "seconds_q75": q75,
            "floor_seconds": statistics.median(floors),
            "ratio": ratio,
            "ratio_q25": ratio_q25,
            "ratio_q75": ratio_q75,
            "per_run": counts[part],
            "run_seconds": counts[part] * seconds,
            "run_floor_seconds": counts[part] * statistics.median(floors),
        }
    total = sum(row["run_seconds"] for row in parts.values())
    floor = sum(row["run_floor_seconds"] for row in parts.values())
    for row in parts.values():
        row["run_share"] = row["run_seconds"] / total
    return {"parts": parts, "run_total_seconds": total, "run_floor_seconds": floor}


def format_table(summary: dict) -> str:
    header = (
        f"{'part':<14} {'seconds':>9} {'(q25-q75)':>19} {'floor s':>9} {'ratio':>6} "
        f"{'(q25-q75)':>13} {'x run':>6} {'run s':>9} {'share':>6}"
    )
    lines = [header, "-" * len(header)]
    for part, row in summary["parts"].items():
        quartiles = f"({row['seconds_q25']:.4f}-{row['seconds_q75']:.4f})"
        ratio_quartiles = f"({row['ratio_q25']:.2f}-{row['ratio_q75']:.2f})"
        lines.append(
            f"{part:<14} {row['seconds']:>9.4f} {quartiles:>19} {row['floor_seconds']:>9.4f} "
            f"{row['ratio']:>6.2f} {ratio_quartiles:>13} {row['per_run']:>6} "
            f"{row['run_seconds']:>9.1f} {row['run_share']:>6.1%}"
        )
    lines.append("-" * len(header))
    total, floor = summary["run_total_seconds"], summary["run_floor_seconds"]
    lines.append(f"run total {total:.1f} s ({total / 3600:.2f} h); its floor {floor:.1f} s")
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None) -> tuple[argparse.Namespace, object]:
    """This script's options; the rest are ``examples/ppo.py``'s (``--quick`` too)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="ppo.py's --quick, one round")
    parser.add_argument("-h", "--help", action="store_true")
    add_output_options(parser)
    arguments, rest = parser.parse_known_args(argv)
    if arguments.help:
        parser.print_help()
        print("\nand examples/ppo.py's options:")
    check_output_option(parser, arguments)
    ppo = load_example("ppo")
    extra = (["--quick"] if arguments.quick else []) + (["--help"] if arguments.help else [])
    config = ppo.parse_args(rest + extra)
    if config.task not in RAW_ENVS:
        parser.error(f"--task {config.task}: the env floor is a raw gymnasium env ({RAW_ENVS})")
    return arguments, config


def main(argv: list[str] | None = None) -> dict:
    arguments, config = parse_arguments(argv)
    torch.set_num_threads(config.threads)
    rounds = arguments.rounds or (1 if arguments.quick else 3)
    ppo, pretrain = load_example("ppo"), load_example("pretrain")
    load_before = load_average()
    job = MainJob(config, ppo, pretrain)
    print(
        f"torch {torch.__version__}, torchrl {torchrl.__version__}, threads "
        f"{torch.get_num_threads()}; {config.num_envs} envs x {job.decisions} decisions = "
        f"{job.decisions_per_batch} decisions / {job.env_steps_per_batch} env steps per batch; "
        f"K={config.sampler.num_denoising_steps}, {job.stochastic_per_decision:g} stochastic "
        f"steps per decision; {rounds} interleaved rounds; load average {load_before}",
        flush=True,
    )
    try:
        measured = []
        for index in range(rounds):
            measured.append(job.measure_round(index))
            print(f"round {index + 1}/{rounds} done", flush=True)
    finally:
        job.close()
    summary = summarise(measured, run_counts(config, job))
    print()
    print(format_table(summary))
    payload = {
        "benchmark": "profile_main_job",
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "load_average": [load_before, load_average()],
        "rounds": rounds,
        "quick": arguments.quick,
        "settings": dataclasses.asdict(config),
        "decisions_per_batch": job.decisions_per_batch,
        "env_steps_per_batch": job.env_steps_per_batch,
        "stochastic_steps_per_decision": job.stochastic_per_decision,
        **summary,
    }
    if arguments.output:
        write_json(arguments.output, payload)
        print(f"wrote {arguments.output}")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
