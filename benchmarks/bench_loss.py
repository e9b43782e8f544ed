"""Learner cost of ``DenoisingClipPPOLoss`` against a plain network step and the naive way.

What it measures: one actor update's forward + backward, per batch of decisions,

* ``loss``: ``DenoisingClipPPOLoss(policy)(data)["loss_objective"].backward()`` on freshly
  sampled data (mixed ODE/SDE sampler, ``K = 8``: one stochastic step per decision), i.e.
  key look-ups, the context, one batched network call over the stochastic entries, the
  Gaussian log-probs, the clipped objective and the diagnostics;
* ``plain``: one forward + backward of the bare velocity network on the same batch
  (the stored ``x_k``, ``sigma_k`` and context of each decision's stochastic step)::

      network(x_k, sigma_k, context).square().mean().backward()

  This is the floor: no learner can score a Gaussian step without one such pass. The goal
  is ``loss / plain <= 1.3``;
* ``naive``: the chain recomputed with gradients from the stored ``x_0`` (``K`` network
  calls, the gradient flowing back through ``x_0 .. x_K``; at the stochastic step the
  sample is the stored ``x_{k+1}`` re-parameterised through the new mean), then the same
  clipped objective. Expect about ``K`` times the plain step.

Networks: ``MLPVelocityNetwork`` (width 1024, 3 hidden layers, observation_dim 23) and the
reference ``ActionExpertTransformer`` + ``ObservationEncoder`` (defaults; the context is
computed under ``no_grad`` by the loss and once, outside the clock, for the baselines), both
with ``action_shape (8, 7)``; batch 256 decisions. float32 on the CPU with
``torch.set_num_threads(1)`` unless ``--threads`` says otherwise.

The three measurements are interleaved, in a rotating order, for several rounds; each round
times a few consecutive calls of each. The table reports median per-call times and the
medians of the per-round ratios. ``--profile`` adds a breakdown of the loss's forward
(context, key look-ups and indexing, network, log-prob, objective and diagnostics).

Run::

    python benchmarks/bench_loss.py                  # full run (a few minutes)
    python benchmarks/bench_loss.py --quick          # smoke run (well under a minute)
    python benchmarks/bench_loss.py --output loss.json --threads 2 --profile
    python benchmarks/bench_loss.py --no-check-data  # the loss without its data checks
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torchrl
from tensordict import TensorDict
from torch import Tensor
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.objectives import DenoisingClipPPOLoss
from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.sampler import SamplerOptions
from torchrl_flowpolicy.training.run_checks import add_output_options, check_output_option
from torchrl_flowpolicy.training.runs import write_json

from benchmark_networks import ACTION_SHAPE, NETWORKS, OBSERVATION_DIM, build_networks

NUM_DENOISING_STEPS = 8
NOISE_LEVEL = 0.5
CLIP_EPSILON = 0.2
GOAL = 1.3
METHODS = ("plain", "loss", "naive")


@dataclass
class Row:
    """One line of the result table."""

    network: str
    batch_size: int
    plain_ms: float
    loss_ms: float
    naive_ms: float
    loss_ratio: float
    loss_ratio_q25: float
    loss_ratio_q75: float
    naive_ratio: float
    naive_over_loss: float
    goal: float
    passed: bool
    rounds: int
    calls_per_round: int


class Workload:
    """A policy, a freshly sampled batch and the three ways to take an actor gradient."""

    def __init__(self, name: str, batch_size: int, check_data: bool = True):
        torch.manual_seed(0)
        network, encoder = build_networks(name)
        self.policy = FlowSDEPolicy(
            network,
            action_shape=ACTION_SHAPE,
            encoder=encoder,
            options=SamplerOptions(
                num_denoising_steps=NUM_DENOISING_STEPS, noise_level=NOISE_LEVEL, sde_mode="mixed"
            ),
        )
        observation = torch.randn(batch_size, OBSERVATION_DIM)
        with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
            self.data = self.policy(TensorDict({"observation": observation}, [batch_size]))
        self.data["advantage"] = torch.randn(batch_size, 1)
        self.loss = DenoisingClipPPOLoss(
            self.policy, clip_epsilon=CLIP_EPSILON, check_data=check_data
        )

        # Inputs of the baselines, prepared once (outside the clock).
        with torch.no_grad():
            self.context = self.policy.context(self.data, grad=False)
        chain = self.data["flow", "chain"]
        self.sde_mask = self.data["flow", "sde_mask"]
        self.old_log_prob = self.data["flow", "step_log_prob"].sum(-1)
        step = self.sde_mask.long().argmax(-1)
        decision = torch.arange(batch_size)
        self.sigmas = flow.sigma_grid(NUM_DENOISING_STEPS)
        self.x_coefficient, self.velocity_coefficient, self.std = flow.step_coefficients(
            self.sigmas, NOISE_LEVEL
        )
        self.step_size = self.sigmas[1:] - self.sigmas[:-1]
        self.chain = chain
        self.plain_x = chain[decision, step]
        self.plain_sigma = self.sigmas[step]

    # ------------------------------------------------------------------ the three methods
    def zero_grad(self) -> None:
        self.policy.zero_grad(set_to_none=True)

    def run_loss(self) -> None:
        self.loss(self.data)["loss_objective"].backward()

    def run_plain(self) -> None:
        velocity = self.policy.velocity_network(self.plain_x, self.plain_sigma, self.context)
        velocity.square().mean().backward()

    def naive_objective(self) -> Tensor:
        """The chain recomputed from ``x_0`` with gradients, then the clipped objective."""
        network = self.policy.velocity_network
        chain, mask = self.chain, self.sde_mask
        batch_size = chain.shape[0]
        x = chain[:, 0]
        log_prob = chain.new_zeros(batch_size)
        for step in range(NUM_DENOISING_STEPS):
            velocity = network(x, self.sigmas[step].expand(batch_size), self.context)
            stochastic = mask[:, step]
            x_coefficient = torch.where(stochastic, self.x_coefficient[step], 1.0)
            velocity_coefficient = torch.where(
                stochastic, self.velocity_coefficient[step], self.step_size[step]
            )
            mean = x_coefficient[:, None, None] * x + velocity_coefficient[:, None, None] * velocity
            sample = chain[:, step + 1]
            if stochastic.any():
                safe_std = torch.where(stochastic, self.std[step], 1.0)
                step_log_prob = flow.gaussian_log_prob(sample, mean, safe_std)
                log_prob = log_prob + torch.where(stochastic, step_log_prob, 0.0)
            # The stored sample, re-parameterised: its value, the new mean's gradient.
            reparameterised = mean + (sample - mean).detach()
            x = torch.where(stochastic[:, None, None], reparameterised, mean)
        log_weight = log_prob - self.old_log_prob
        advantage = self.data["advantage"].squeeze(-1)
        ratio = log_weight.exp()
        clipped = ratio.clamp(1 - CLIP_EPSILON, 1 + CLIP_EPSILON)
        return -torch.minimum(ratio * advantage, clipped * advantage).mean()

    def run_naive(self) -> None:
        self.naive_objective().backward()

    def method(self, name: str) -> Callable[[], None]:
        return {"plain": self.run_plain, "loss": self.run_loss, "naive": self.run_naive}[name]

    def check(self) -> None:
        """The loss and the naive objective agree on fresh data (ratios 1)."""
        out = self.loss(self.data)
        naive = self.naive_objective()
        if not torch.allclose(out["loss_objective"], naive, atol=1e-4, rtol=1e-4):
            raise RuntimeError(
                f"naive objective {float(naive):.6f} differs from the loss "
                f"{float(out['loss_objective']):.6f} on fresh data."
            )
        if int(out["num_stochastic_steps"]) != self.chain.shape[0]:
            raise RuntimeError("mixed mode should have one stochastic step per decision.")


def time_calls(workload: Workload, function: Callable[[], None], calls: int) -> float:
    """Seconds per call over ``calls`` consecutive calls (gradients cleared off the clock)."""
    total = 0.0
    for _ in range(calls):
        workload.zero_grad()
        start = time.perf_counter()
        function()
        total += time.perf_counter() - start
    return total / calls


def measure(
    name: str,
    batch_size: int,
    *,
    rounds: int,
    calls_per_round: int,
    warmup: int,
    check_data: bool = True,
) -> Row:
    """Interleaved timing of the three methods for one network."""
    workload = Workload(name, batch_size, check_data)
    workload.check()
    for method in METHODS:
        time_calls(workload, workload.method(method), warmup)
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    for index in range(rounds):
        # Rotate the order (plain loss naive, loss naive plain, ...) so drifts cancel.
        order = METHODS[index % 3 :] + METHODS[: index % 3]
        for method in order:
            times[method].append(time_calls(workload, workload.method(method), calls_per_round))

    def ratios(numerator: str, denominator: str) -> list[float]:
        return [a / b for a, b in zip(times[numerator], times[denominator], strict=True)]

    loss_ratios = ratios("loss", "plain")
    naive_ratios = ratios("naive", "plain")
    naive_over_loss = ratios("naive", "loss")
    quartiles = (
        statistics.quantiles(loss_ratios, n=4) if len(loss_ratios) > 1 else [loss_ratios[0]] * 3
    )
    loss_ratio = statistics.median(loss_ratios)
    return Row(
        network=name,
        batch_size=batch_size,
        plain_ms=1e3 * statistics.median(times["plain"]),
        loss_ms=1e3 * statistics.median(times["loss"]),
        naive_ms=1e3 * statistics.median(times["naive"]),
        loss_ratio=loss_ratio,
        loss_ratio_q25=quartiles[0],
        loss_ratio_q75=quartiles[2],
        naive_ratio=statistics.median(naive_ratios),
        naive_over_loss=statistics.median(naive_over_loss),
        goal=GOAL,
        passed=loss_ratio <= GOAL,
        rounds=rounds,
        calls_per_round=calls_per_round,
    )


def profile(
    name: str, batch_size: int, *, repeats: int, check_data: bool = True
) -> dict[str, float]:
    """Median milliseconds of the pieces of the loss's forward (and the backward).

    Each piece is timed on its own, in the loss's order, ``repeats`` times; the pieces are
    the loss's own building blocks called the way ``forward`` calls them.
    """
    workload = Workload(name, batch_size, check_data)
    loss, policy, data = workload.loss, workload.policy, workload.data
    pieces: dict[str, Callable[[], object]] = {
        "clone(False)": lambda: data.clone(False),
        "advantage": lambda: loss.advantage(data),
        "context (no_grad)": lambda: policy.context(data, grad=False),
        "stored chain + mask": lambda: policy.stored_chain(data),
        "nonzero + gather": lambda: _gather(data),
        "network forward": lambda: policy.velocity_network(
            workload.plain_x, workload.plain_sigma, workload.context
        ),
        "stochastic_steps (all)": lambda: loss.stochastic_steps(data),
    }
    steps = loss.stochastic_steps(data)
    log_prob = policy.sampler.log_prob(steps)
    pieces["gaussian_log_prob"] = lambda: policy.sampler.log_prob(steps)
    pieces["old log-prob gather"] = lambda: loss.old_step_log_prob(data, steps)
    shape = data["flow", "sde_mask"].shape
    sde_mask = flow.scatter_steps(steps, torch.ones_like(steps.step_index, dtype=torch.bool), shape)
    pieces["reduce (scatter + mask)"] = lambda: loss.reduce_steps(
        flow.scatter_steps(steps, log_prob, shape), sde_mask, data
    )
    pieces["loss forward (total)"] = lambda: loss(data)
    times: dict[str, list[float]] = {piece: [] for piece in pieces}
    for _ in range(repeats):
        for piece, function in pieces.items():
            start = time.perf_counter()
            function()
            times[piece].append(time.perf_counter() - start)
    # Backward alone: forward off the clock.
    backward_times, plain_backward_times = [], []
    for _ in range(repeats):
        workload.zero_grad()
        objective = loss(data)["loss_objective"]
        start = time.perf_counter()
        objective.backward()
        backward_times.append(time.perf_counter() - start)
        workload.zero_grad()
        velocity = policy.velocity_network(workload.plain_x, workload.plain_sigma, workload.context)
        plain = velocity.square().mean()
        start = time.perf_counter()
        plain.backward()
        plain_backward_times.append(time.perf_counter() - start)
    result = {piece: 1e3 * statistics.median(values) for piece, values in times.items()}
    result["loss backward"] = 1e3 * statistics.median(backward_times)
    result["plain backward"] = 1e3 * statistics.median(plain_backward_times)
    return result


def _gather(data: TensorDict) -> tuple[Tensor, Tensor]:
    chain = data["flow", "chain"]
    decision, step = data["flow", "sde_mask"].nonzero(as_tuple=True)
    return chain[decision, step], chain[decision, step + 1]


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'network':<12} {'batch':>5} {'plain ms':>9} {'loss ms':>9} {'naive ms':>9} "
        f"{'loss/plain':>10} {'(q25-q75)':>13} {'naive/plain':>11} {'naive/loss':>10} "
        f"{'goal':>5}  result"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.network:<12} {row.batch_size:>5} {row.plain_ms:>9.2f} {row.loss_ms:>9.2f} "
            f"{row.naive_ms:>9.2f} {row.loss_ratio:>10.3f} "
            f"{f'({row.loss_ratio_q25:.3f}-{row.loss_ratio_q75:.3f})':>13} "
            f"{row.naive_ratio:>11.2f} {row.naive_over_loss:>10.2f} {row.goal:>5.2f}  "
            f"{'pass' if row.passed else 'FAIL'}"
        )
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--batch-size", type=int, default=256, help="decisions per batch")
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument(
        "--calls-per-round", type=int, default=None, help="consecutive calls timed per round"
    )
    parser.add_argument("--profile", action="store_true", help="break the loss's time down")
    parser.add_argument(
        "--no-check-data",
        action="store_true",
        help="DenoisingClipPPOLoss(check_data=False): without the checks of the stored data",
    )
    add_output_options(parser)
    arguments = parser.parse_args(argv)
    check_output_option(parser, arguments)
    return arguments


def main(argv: list[str] | None = None) -> list[Row]:
    arguments = parse_arguments(argv)
    torch.set_num_threads(arguments.threads)
    rounds = arguments.rounds or (3 if arguments.quick else 10)
    calls_per_round = arguments.calls_per_round or (1 if arguments.quick else 2)
    warmup = 1 if arguments.quick else 3
    print(
        f"torch {torch.__version__}, torchrl {torchrl.__version__}, threads "
        f"{torch.get_num_threads()}, K={NUM_DENOISING_STEPS}, noise_level={NOISE_LEVEL}, mixed, "
        f"batch {arguments.batch_size}; {rounds} interleaved rounds x {calls_per_round} calls"
        + ("; check_data=False" if arguments.no_check_data else "")
    )
    rows = []
    profiles = {}
    for name in arguments.networks:
        row = measure(
            name,
            arguments.batch_size,
            rounds=rounds,
            calls_per_round=calls_per_round,
            warmup=warmup,
            check_data=not arguments.no_check_data,
        )
        rows.append(row)
        print(format_table([row]).splitlines()[-1], flush=True)
        if arguments.profile:
            profiles[name] = profile(
                name,
                arguments.batch_size,
                repeats=5 if arguments.quick else 15,
                check_data=not arguments.no_check_data,
            )
    print()
    print(format_table(rows))
    for name, pieces in profiles.items():
        print(f"\nprofile ({name}, batch {arguments.batch_size}), median ms:")
        for piece, milliseconds in pieces.items():
            print(f"  {piece:<26} {milliseconds:>9.3f}")
    if arguments.output:
        payload = {
            "benchmark": "loss",
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "num_denoising_steps": NUM_DENOISING_STEPS,
            "noise_level": NOISE_LEVEL,
            "sde_mode": "mixed",
            "action_shape": list(ACTION_SHAPE),
            "quick": arguments.quick,
            "check_data": not arguments.no_check_data,
            "rows": [asdict(row) for row in rows],
            "profiles": profiles,
        }
        write_json(arguments.output, payload)
        print(f"wrote {arguments.output}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
