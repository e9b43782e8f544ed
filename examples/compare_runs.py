"""Compare finished runs: one PNG of their evaluation curves and a Markdown table.

Reads the ``summary.json`` that ``examples/ppo.py`` (and ``examples/dsrl.py``) write::

    python examples/compare_runs.py --output docs/results/seeds.png --overwrite \\
        --runs "seed 0=outputs/ppo_seed0/summary.json" "seed 1=outputs/ppo_seed1/summary.json"

Every input is checked and read before anything is drawn; the ``--output`` PNG is never one
of the inputs, and an existing one is replaced only with ``--overwrite``.

Each curve is the run's own learning-curve success (its evaluation sampler, e.g. the ODE
at ``eval_num_denoising_steps`` from ``x_0 ~ N(0, I)`` for ``examples/ppo.py``) against environment
steps (and, with ``--wall_time``, against wall-clock minutes), starting from the run's BC level at step 0
unless the run evaluated its own starting point (DSRL does); each run's BC level is a
dashed line, and its noise-free BC level (``x_0 = 0``, written by ``examples/dsrl.py``) a
dotted one.

Runs given the same label are one method over several seeds: their curve is the mean over
the runs at each evaluation point (the runs must share their evaluation steps), with the
lowest and highest run as a band, against the mean wall time at that point; the table then
lists each run's final success after the mean::

    python examples/compare_runs.py --output docs/results/methods.png --overwrite --wall_time \
        --runs "GAE=outputs/gae_s0/summary.json" "GAE=outputs/gae_s1/summary.json" \
               "GRPO=outputs/grpo_s0/summary.json" "GRPO=outputs/grpo_s1/summary.json"
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean as mean

import matplotlib
import torch

from torchrl_flowpolicy.tasks.registry import TASKS
from torchrl_flowpolicy.training.loggers import read_csv_log
from torchrl_flowpolicy.training.statistics import paired_bootstrap_interval

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from torchrl_flowpolicy.training.run_checks import (  # noqa: E402
    check_input_file,
    check_not_an_input,
    check_output_file,
)
from torchrl_flowpolicy.training.runs import save_figure  # noqa: E402

from common import option, parse_config  # noqa: E402
from run_settings import validate_config  # noqa: E402


@dataclass
class CompareConfig:
    """What to compare and where to draw it; every field is a command-line option."""

    runs: list[str] = option(help="the runs, each as LABEL=path/to/summary.json")
    output: str = option(help="the PNG to write")
    title: str = option(
        "",
        "the figure's title (default: the runs' task and evaluation sampler, from their summaries)",
    )
    wall_time: bool = option(False, "also plot success against wall-clock minutes")
    held_out: bool = option(
        False, "also tabulate each run's held-out protocol (examples/ppo.py writes it)"
    )
    baseline: str = option(
        "",
        "with --held_out: the label whose runs the others are compared with, paired episode by "
        "episode (same seed, same held-out states) in the reported decoding",
    )
    diagnostics: bool = option(
        False,
        "with --held_out: add each run's mean PPO clip fraction and approximate KL over its "
        "iterations (read from its CSV log) and its wall time",
    )
    overwrite: bool = option(False, "replace an existing --output")

    def option_conflicts(self) -> list[str]:
        """Options given without what reads them."""
        conflicts = []
        if self.baseline and not self.held_out:
            conflicts.append(f"--baseline {self.baseline}: only with --held_out")
        if self.diagnostics and not self.held_out:
            conflicts.append("--diagnostics: only with --held_out")
        return conflicts


def run_path(specification: str) -> tuple[str, Path]:
    """``"label=path"`` -> ``(label, path)`` (the label may contain ``=``), the path checked."""
    label, _, path = specification.rpartition("=")
    if not label or not path:
        raise ValueError(f"--runs: expected LABEL=PATH, got {specification!r}.")
    return label, check_input_file(path, "--runs")


def load(specification: str) -> tuple[str, dict]:
    """``"label=path"`` -> ``(label, summary)`` (the label may contain ``=``)."""
    label, path = run_path(specification)
    try:
        return label, json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--runs {label}={path}: not a run's summary.json ({error}).") from None


def check_config(config: CompareConfig) -> list[tuple[str, dict]]:
    """Every option checked, and every summary read, before anything is drawn or written:
    the runs (``LABEL=PATH`` of an existing JSON file each), ``--baseline`` among their
    labels, an ``--output`` PNG that is none of them and, unless ``--overwrite``, new."""
    validate_config(config)
    runs = [load(specification) for specification in config.runs]
    labels = list(dict.fromkeys(label for label, _ in runs))
    if config.baseline and config.baseline not in labels:
        raise ValueError(f"--baseline {config.baseline!r} is not a label of --runs: {labels}.")
    paths = [run_path(specification)[1] for specification in config.runs]
    check_not_an_input({"--output": [config.output]}, {"--runs": paths})
    if Path(config.output).suffix.lower() != ".png":
        raise ValueError(f"--output {config.output}: the figure is a PNG; name it *.png.")
    check_output_file(config.output, "--output", overwrite=config.overwrite)
    return runs


def curve(summary: dict) -> tuple[list[float], list[float], list[float]]:
    """A run's evaluation curve: env steps, success (%) and wall minutes, from its BC level
    at step 0 unless the run evaluated its own start."""
    history = summary["history"]
    steps = [row["env_steps"] for row in history]
    success = [100 * row["success_rate"] for row in history]
    minutes = [row.get("wall_seconds", float("nan")) / 60 for row in history]
    if not steps or steps[0] != 0:
        steps, success = [0, *steps], [100 * summary["bc_success"], *success]
        minutes = [0.0, *minutes]
    return steps, success, minutes


def default_title(summaries: list[dict]) -> str:
    """The runs' task and the curve's sampler, e.g. ``"Pusher-v5: evaluation success (ODE,
    K = 20)"``, from the summaries' configs (Pusher, K = 20 where a summary has none)."""
    configs = [summary.get("config", {}) for summary in summaries]
    tasks = sorted({config.get("task", "pusher") for config in configs})
    steps = sorted({config.get("eval_num_denoising_steps", 20) for config in configs})
    names = " / ".join(TASKS[task].title if task in TASKS else task for task in tasks)
    return f"{names}: evaluation success (ODE, K = {' / '.join(map(str, steps))})"


def group(runs: list[tuple[str, dict]]) -> dict[str, list[dict]]:
    """The runs by label, in the order each label first appears."""
    groups: dict[str, list[dict]] = {}
    for label, summary in runs:
        groups.setdefault(label, []).append(summary)
    return groups


def percent(rate: dict) -> str:
    return f"{100 * rate['rate']:.1f} %"


def logged_mean(summary: dict, name: str) -> float | None:
    """The mean over the run's iterations of the scalar ``name`` (``clip_fraction``,
    ``kl_approx``) in the CSV log under the run's ``output_dir``; ``None`` when the run
    logged no CSV."""
    try:
        values = [value for _, value in read_csv_log(summary["config"]["output_dir"]).get(name, [])]
    except FileNotFoundError:
        return None
    return mean(values) if values else None


def diagnostics_cells(summary: dict) -> str:
    """`` clip | kl | minutes |``: the run's mean clip fraction and KL, and its wall time."""
    cells = []
    for name, digits in (("clip_fraction", 3), ("kl_approx", 4)):
        value = logged_mean(summary, name)
        cells.append("n/a" if value is None else f"{value:.{digits}f}")
    return f" {cells[0]} | {cells[1]} | {summary['wall_seconds'] / 60:.1f} |"


def held_out_table(groups: dict[str, list[dict]], baseline: str, diagnostics: bool = False) -> None:
    """Each run's held-out protocol, and with ``baseline`` its paired difference in the
    reported decoding from the baseline's run of the same seed, per seed and pooled over
    the seeds (the episodes of all seeds, each still paired with its own); with
    ``diagnostics``, each run's mean clip fraction and KL (:func:`logged_mean`) and wall time."""
    if baseline and baseline not in groups:
        raise ValueError(f"--baseline {baseline!r} is not a label of --runs: {list(groups)}.")
    reference = {summary["seed"]: summary for summary in groups.get(baseline, [])}
    print()
    header = "| run | seed | RL sampled | RL noise-free | BC best | expert |"
    header += f" reported − {baseline} |" if baseline else ""
    header += " clip fraction | KL | wall time (min) |" if diagnostics else ""
    print(header)
    print("| --- " * (6 + bool(baseline) + 3 * diagnostics) + "|")
    for label, summaries in groups.items():
        pooled_first, pooled_second = [], []
        for summary in summaries:
            protocol = summary["held_out"]
            success, decoding = protocol["success"], protocol["reported_decoding"]
            bc_best = success["bc"][protocol["bc_best_decoding"]]
            row = (
                f"| {label} | {summary['seed']} | {percent(success['rl']['sampled'])} | "
                f"{percent(success['rl']['noise_free'])} | {percent(bc_best)} | "
                f"{percent(success['expert'])} |"
            )
            if baseline and label != baseline:
                other = reference.get(summary["seed"])
                if other is None:
                    raise ValueError(f"{baseline!r} has no run of seed {summary['seed']}.")
                if other["held_out"]["seed"] != protocol["seed"]:
                    raise ValueError("the runs were not evaluated on the same held-out states.")
                first = torch.tensor(protocol["episode_success"]["rl"][decoding])
                second = torch.tensor(other["held_out"]["episode_success"]["rl"][decoding])
                pooled_first.append(first)
                pooled_second.append(second)
                row += difference(first, second)
            elif baseline:
                row += " |"
            if diagnostics:
                row += diagnostics_cells(summary)
            print(row)
        if len(pooled_first) > 1:
            pooled = difference(torch.cat(pooled_first), torch.cat(pooled_second))
            print(f"| {label} | pooled | | | | |{pooled}" + " | | |" * diagnostics)


def difference(first: torch.Tensor, second: torch.Tensor) -> str:
    """`` +d [low, high] |``: the paired difference in points and its 95 % interval."""
    value, low, high = paired_bootstrap_interval(first, second)
    return f" {100 * value:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] |"


def main(config: CompareConfig) -> None:
    groups = group(check_config(config))  # before anything is drawn or written
    columns = 2 if config.wall_time else 1
    figure, axes = plt.subplots(1, columns, figsize=(6 * columns, 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    print("| run | BC success | final success | env steps | wall time (min) |")
    print("| --- | --- | --- | --- | --- |")
    for index, (label, summaries) in enumerate(groups.items()):
        color = colors[index % len(colors)]
        curves = [curve(summary) for summary in summaries]
        steps = curves[0][0]
        if any(other[0] != steps for other in curves[1:]):
            raise ValueError(
                f"the runs labelled {label!r} evaluated at different env steps; "
                "give them different labels."
            )
        success = [list(point) for point in zip(*(c[1] for c in curves), strict=True)]
        minutes = [mean(list(point)) for point in zip(*(c[2] for c in curves), strict=True)]
        middle = [mean(point) for point in success]
        name = label if len(summaries) == 1 else f"{label} (mean of {len(summaries)})"
        for axis, x in zip(axes[0], (steps, minutes), strict=False):
            axis.plot(x, middle, "o-", color=color, label=name, markersize=3)
            if len(summaries) > 1:
                low, high = [min(p) for p in success], [max(p) for p in success]
                axis.fill_between(x, low, high, color=color, alpha=0.15, linewidth=0)
        bc = mean([100 * summary["bc_success"] for summary in summaries])
        axes[0][0].axhline(bc, color=color, linestyle="--", alpha=0.5)
        if all("bc_noise_free_success" in summary for summary in summaries):
            noise_free = mean([100 * s["bc_noise_free_success"] for s in summaries])
            axes[0][0].axhline(noise_free, color=color, linestyle=":", alpha=0.6)
        final = [100 * summary["rl_success"] for summary in summaries]
        each = "" if len(final) == 1 else " (" + " / ".join(f"{v:.0f}" for v in final) + ")"
        wall = mean([summary["wall_seconds"] / 60 for summary in summaries])
        print(
            f"| {label} | {bc:.0f} % | {mean(final):.0f} %{each} | "
            f"{summaries[0]['env_steps']:,} | {wall:.1f} |"
        )
    axes[0][0].set(xlabel="environment steps", ylabel="success (%)", ylim=(-2, 102))
    if config.wall_time:
        axes[0][1].set(xlabel="wall time (min)", ylabel="success (%)", ylim=(-2, 102))
    for axis in axes[0]:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(config.title or default_title([s for runs in groups.values() for s in runs]))
    figure.tight_layout()
    save_figure(figure, config.output)
    print(f"wrote {config.output}")
    if config.held_out:
        held_out_table(groups, config.baseline, config.diagnostics)


if __name__ == "__main__":
    main(parse_config(CompareConfig, description=__doc__))
