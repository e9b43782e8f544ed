"""What a fine-tuning run reports: its baselines, the held-out protocol, summary and plot.

A run's settings object (an example's config: any object with the attributes of
:class:`RunSettings` and its task's options) says which task, which horizon and how many
episodes. From it:

* :func:`curve_baselines`: the lines of the learning curve, on the curve seeds: BC under
  both decodings and the clean scripted expert;
* :func:`held_out_protocol`: the evaluation protocol on held-out seeds
  (:func:`~torchrl_flowpolicy.training.protocol.protocol_summary`: BC and RL under both decodings,
  the expert, all on the same states and initial noise);
* :func:`evaluate_on_curve`: a learning-curve point (deterministic, on the curve seeds);
* :func:`run_summary`: the fields every run's ``summary.json`` holds;
* :func:`plot_learning_curve`: success (with Wilson bands) and return against env steps;
* :func:`write_run_report`: a run's end: the plot, ``summary.json`` and its result lines.

Every evaluation leaves torch's random generator alone (the evaluations draw their noise
from their own seeded generators), so reporting does not change a run's numbers.

Example:
    >>> decisions_per_episode(150, 4)
    38
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from tensordict.nn import TensorDictModuleBase
from torch import Tensor
from torchrl.envs import EnvBase

from torchrl_flowpolicy.policy import FlowSDEPolicy
from torchrl_flowpolicy.tasks.registry import get_task
from torchrl_flowpolicy.training.collectors import make_task_env
from torchrl_flowpolicy.training.evaluation import evaluate_decodings, evaluate_policy
from torchrl_flowpolicy.training.protocol import (
    CURVE_SEED,
    evaluate_expert,
    format_protocol,
    protocol_summary,
    split_seed,
)
from torchrl_flowpolicy.training.runs import save_figure, write_json
from torchrl_flowpolicy.training.statistics import wilson_interval

__all__ = [
    "RunSettings",
    "task_options",
    "decisions_per_episode",
    "make_eval_env",
    "outcome_summary",
    "evaluate_task_expert",
    "curve_baselines",
    "evaluate_on_curve",
    "held_out_protocol",
    "run_summary",
    "plot_learning_curve",
    "write_run_report",
]


class RunSettings(Protocol):
    """The settings a report reads from a run's config (besides the task's options)."""

    seed: int
    task: str
    max_episode_steps: int
    eval_episodes: int
    held_out_episodes: int
    reported_decoding: str


def task_options(config: Any) -> dict[str, Any]:
    """The task settings of a config (``config.task`` names the task), as keyword arguments
    of the task's environment factory (:meth:`~torchrl_flowpolicy.tasks.registry.Task.options`)."""
    return get_task(config.task).options(config)


def decisions_per_episode(max_episode_steps: int, executed_chunk_length: int) -> int:
    """How many decisions cover one episode."""
    return math.ceil(max_episode_steps / executed_chunk_length)


def make_eval_env(
    config: RunSettings,
    num_episodes: int,
    executed_chunk_length: int,
    device: torch.device | str | None = None,
) -> EnvBase:
    """The chunked task environment for an evaluation of ``num_episodes`` episodes: one
    sub-environment per episode, or the task's ``max_eval_envs`` (the episodes then run in
    rounds; pass ``num_episodes`` to the evaluation). ``device`` is the evaluated policy's:
    ``env.rollout`` hands the policy the environment's tensors as they are."""
    num_envs = get_task(config.task).eval_envs(num_episodes)
    return make_task_env(
        config.task,
        num_envs,
        executed_chunk_length,
        task_options=task_options(config),
        device=device,
    )


def outcome_summary(outcomes: Mapping[str, Tensor]) -> dict[str, float]:
    """Success rate (with its Wilson 95 % interval), mean return and count of an evaluation."""
    successes, trials = int(outcomes["success"].sum()), outcomes["success"].numel()
    low, high = wilson_interval(successes, trials)
    return {
        "success_rate": successes / trials,
        "success_low": low,
        "success_high": high,
        "mean_return": outcomes["return"].float().mean().item(),
        "num_episodes": trials,
    }


def evaluate_task_expert(config: RunSettings, num_episodes: int, seed: int) -> dict[str, Tensor]:
    """The clean scripted expert of ``config.task`` on ``num_episodes`` seeded episodes."""
    return evaluate_expert(num_episodes, seed=seed, task=config.task, **task_options(config))


def curve_baselines(
    bc_policy: FlowSDEPolicy, env: EnvBase, max_decisions: int, config: RunSettings
) -> dict[str, dict[str, float]]:
    """The lines of the learning-curve plot, on the curve seeds: BC under both decodings and
    the clean expert (:func:`outcome_summary` each), printed."""
    options = {"max_decisions": max_decisions, "num_episodes": config.eval_episodes}
    bc = evaluate_decodings(bc_policy, env, seed=CURVE_SEED, **options)
    expert = evaluate_task_expert(config, config.eval_episodes, CURVE_SEED)
    baselines = {
        "BC (sampled)": outcome_summary(bc["sampled"]),
        "BC (noise-free)": outcome_summary(bc["noise_free"]),
        "expert": outcome_summary(expert),
    }
    print(
        "curve seeds: "
        + "; ".join(f"{name} {row['success_rate']:.1%}" for name, row in baselines.items())
    )
    return baselines


def evaluate_on_curve(
    policy: TensorDictModuleBase, env: EnvBase, max_decisions: int, num_episodes: int
) -> dict[str, float]:
    """A point of the learning curve: ``policy`` under deterministic exploration on the
    ``num_episodes`` curve episodes (seeds ``CURVE_SEED``+), as
    :func:`~torchrl_flowpolicy.training.evaluation.evaluate_policy` summarises it."""
    return evaluate_policy(
        policy, env, max_decisions=max_decisions, seed=CURVE_SEED, num_episodes=num_episodes
    )


def held_out_protocol(
    bc_policy: FlowSDEPolicy,
    rl_policy: TensorDictModuleBase,
    config: RunSettings,
    executed_chunk_length: int,
    rl_env: EnvBase | None = None,
    name: str = "RL",
    device: torch.device | str | None = None,
    env: EnvBase | None = None,
    split: Literal["held_out", "validation"] = "held_out",
) -> dict[str, Any]:
    """The evaluation protocol on ``config.held_out_episodes`` held-out episodes.

    BC and RL under both decodings
    (:func:`~torchrl_flowpolicy.training.evaluation.evaluate_decodings`) and the clean expert,
    all on the same states and the same initial noise;
    :func:`~torchrl_flowpolicy.training.protocol.protocol_summary` with
    ``config.reported_decoding``.
    ``rl_env`` is RL's environment with as many sub-environments as :func:`make_eval_env`
    gives (default: the chunked task, as BC's). ``"line"`` holds
    :func:`~torchrl_flowpolicy.training.protocol.format_protocol`'s sentence about ``name``.
    ``device``: the policies' device (that of BC's environment). ``env``: BC's environment
    (default: :func:`make_eval_env`'s; one passed here is the caller's to close).
    ``split="validation"`` runs the same protocol on the validation seeds (to choose settings
    on; the number it gives is not a result).
    """
    seed = split_seed(split, config.held_out_episodes)
    max_decisions = decisions_per_episode(config.max_episode_steps, executed_chunk_length)
    own_env = env is None
    if own_env:
        env = make_eval_env(config, config.held_out_episodes, executed_chunk_length, device)
    options = {
        "max_decisions": max_decisions,
        "seed": seed,
        "num_episodes": config.held_out_episodes,
    }
    bc = evaluate_decodings(bc_policy, env, **options)
    rl = evaluate_decodings(rl_policy, env if rl_env is None else rl_env, **options)
    if own_env:
        env.close()
    expert = evaluate_task_expert(config, config.held_out_episodes, seed)
    summary = protocol_summary(bc, rl, expert, reported_decoding=config.reported_decoding)
    return {"split": split, "seed": seed, "line": format_protocol(summary, name), **summary}


def run_summary(
    config: RunSettings,
    baselines: Mapping[str, Mapping[str, float]],
    history: Sequence[Mapping[str, Any]],
    held_out: Mapping[str, Any],
    pretrained_state: Mapping[str, Any],
    **fields: Any,
) -> dict[str, Any]:
    """The fields of a run's ``summary.json``: on the curve seeds the baselines (BC under
    both decodings, the expert) and the final level (the history's last row), the held-out
    protocol, the history, the run's config and the pretraining's summary; ``fields`` adds
    or replaces entries (counters, wall times)."""
    bc, final = baselines["BC (sampled)"], history[-1]
    return {
        "seed": config.seed,
        "bc_success": bc["success_rate"],
        "rl_success": final["success_rate"],
        "bc_return": bc["mean_return"],
        "rl_return": final["mean_return"],
        "bc_noise_free_success": baselines["BC (noise-free)"]["success_rate"],
        "expert_success": baselines["expert"]["success_rate"],
        "curve_baselines": dict(baselines),
        "held_out": dict(held_out),
        "env_steps": final["env_steps"],
        "iterations": final["iteration"],
        "eval_episodes": config.eval_episodes,
        **fields,
        "history": list(history),
        "config": dataclasses.asdict(config),
        "pretrained": json.loads(pretrained_state.get("summary", "{}")),
    }


def _success_band(axis: Any, x: Sequence[float], rows: Sequence[Mapping], **style) -> None:
    """A success curve (percent) of evaluation rows with the band of their Wilson intervals."""
    intervals = [
        wilson_interval(round(row["success_rate"] * row["num_episodes"]), row["num_episodes"])
        for row in rows
    ]
    (line,) = axis.plot(x, [100 * row["success_rate"] for row in rows], "o-", **style)
    low, high = zip(*intervals, strict=True)
    axis.fill_between(
        x, [100 * v for v in low], [100 * v for v in high], alpha=0.2, color=line.get_color()
    )


def _baseline_lines(axis: Any, baselines: Mapping[str, Mapping[str, float]]) -> None:
    """Each baseline's success as a horizontal line (percent) with its Wilson band."""
    for (label, row), color in zip(
        baselines.items(), ("tab:gray", "tab:olive", "tab:green"), strict=False
    ):
        axis.axhline(100 * row["success_rate"], color=color, linestyle="--", label=label)
        axis.axhspan(100 * row["success_low"], 100 * row["success_high"], color=color, alpha=0.12)


def plot_learning_curve(
    history: Sequence[Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, float]],
    path: str | Path,
    *,
    title: str,
    label: str,
    wall_time: bool = False,
) -> Path:
    """A PNG at ``path``: success and return of ``history`` (curve ``label``) against env
    steps, and with ``wall_time`` success against the training wall time; the baselines
    as lines, success with Wilson 95 % bands; ``title`` above (matplotlib needed)."""
    from matplotlib.figure import Figure  # the examples' extra; no pyplot state

    steps = [row["env_steps"] for row in history]
    figure = Figure(figsize=(16, 4) if wall_time else (11, 4))
    axes = figure.subplots(1, 3 if wall_time else 2)
    success_axis, return_axis = axes[0], axes[1]
    curves = [(success_axis, steps)]
    if wall_time:
        curves.append((axes[2], [row["wall_seconds"] / 60 for row in history]))
        axes[2].set(xlabel="training wall time (min)", ylabel="success (%)", ylim=(-2, 102))
    for axis, x in curves:
        _success_band(axis, x, history, label=label)
        _baseline_lines(axis, baselines)
    success_axis.set(xlabel="environment steps", ylabel="success (%)", ylim=(-2, 102))
    return_axis.plot(steps, [row["mean_return"] for row in history], "o-", label=label)
    for (name, row), style in zip(baselines.items(), ("--", ":", "-."), strict=False):
        return_axis.axhline(row["mean_return"], color="gray", linestyle=style, label=name)
    return_axis.set(xlabel="environment steps", ylabel="episode return")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    caption = (
        f"{title} on {history[-1]['num_episodes']} curve episodes (seeds {CURVE_SEED}+), "
        "95 % Wilson bands"
    )  # wrapped to the figure's width (about 11 characters an inch at the default size)
    figure.suptitle(textwrap.fill(caption, width=int(11 * figure.get_figwidth())))
    figure.tight_layout()
    return save_figure(figure, path)


def write_run_report(
    output_dir: str | Path,
    summary: Mapping[str, Any],
    *,
    name: str,
    title: str,
    label: str,
    wall_time: bool = False,
) -> None:
    """A run's report in ``output_dir``, from its :func:`run_summary` (which holds
    ``"wall_seconds"``): ``learning_curve.png`` (:func:`plot_learning_curve` of the history
    against the curve baselines), ``summary.json`` and two printed lines: BC's and
    ``name``'s success on the curve seeds (with the update count, if the summary has one),
    then the held-out protocol's sentence."""
    output_dir = Path(output_dir)
    history, baselines = summary["history"], summary["curve_baselines"]
    curve = output_dir / "learning_curve.png"
    plot_learning_curve(history, baselines, curve, title=title, label=label, wall_time=wall_time)
    write_json(output_dir / "summary.json", summary)
    updates = f", {summary['updates']} updates" if "updates" in summary else ""
    print(
        f"curve seeds: BC success {summary['bc_success']:.1%} -> {name} success "
        f"{summary['rl_success']:.1%} after {summary['env_steps']} env steps{updates} "
        f"({summary['wall_seconds'] / 60:.1f} min)"
    )
    states = "validation" if summary["held_out"].get("split") == "validation" else "held-out"
    print(f"{states} seeds: {summary['held_out']['line']}")
