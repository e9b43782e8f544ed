"""Compare finished runs: one PNG of their evaluation curves and a Markdown table.

Reads the ``summary.json`` that ``examples/ppo.py`` (and ``examples/dsrl.py``) write::

    python examples/compare_runs.py --output docs/results/seeds.png \\
        --runs "seed 0=outputs/ppo_seed0/summary.json" "seed 1=outputs/ppo_seed1/summary.json"

Each curve is the deterministic evaluation success against environment steps (and, with
``--wall_time``, against wall-clock minutes), starting from the run's BC level at step 0
unless the run evaluated its own starting point (DSRL does); each run's BC level is a
dashed line, and its noise-free BC level (``x_0 = 0``, written by ``examples/dsrl.py``) a
dotted one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import option, parse_config  # noqa: E402


@dataclass
class CompareConfig:
    """What to compare and where to draw it; every field is a command-line option."""

    runs: list[str] = option(help="the runs, each as LABEL=path/to/summary.json")
    output: str = option(help="the PNG to write")
    title: str = option("Pusher-v5: deterministic evaluation (ODE, K = 20)", "the figure's title")
    wall_time: bool = option(False, "also plot success against wall-clock minutes")


def load(specification: str) -> tuple[str, dict]:
    """``"label=path"`` -> ``(label, summary)`` (the label may contain ``=``)."""
    label, _, path = specification.rpartition("=")
    if not path:
        raise ValueError(f"expected LABEL=PATH, got {specification!r}.")
    return label, json.loads(Path(path).read_text())


def main(config: CompareConfig) -> None:
    runs = [load(specification) for specification in config.runs]
    columns = 2 if config.wall_time else 1
    figure, axes = plt.subplots(1, columns, figsize=(6 * columns, 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    print("| run | BC success | final success | env steps | wall time (min) |")
    print("| --- | --- | --- | --- | --- |")
    for index, (label, summary) in enumerate(runs):
        color = colors[index % len(colors)]
        history = summary["history"]
        steps = [row["env_steps"] for row in history]
        success = [100 * row["success_rate"] for row in history]
        minutes = [row.get("wall_seconds", float("nan")) / 60 for row in history]
        if not steps or steps[0] != 0:
            steps, success = [0, *steps], [100 * summary["bc_success"], *success]
            minutes = [0.0, *minutes]
        axes[0][0].plot(steps, success, "o-", color=color, label=label, markersize=3)
        axes[0][0].axhline(100 * summary["bc_success"], color=color, linestyle="--", alpha=0.5)
        if "bc_noise_free_success" in summary:
            noise_free = 100 * summary["bc_noise_free_success"]
            axes[0][0].axhline(noise_free, color=color, linestyle=":", alpha=0.6)
        if config.wall_time:
            axes[0][1].plot(minutes, success, "o-", color=color, label=label, markersize=3)
        print(
            f"| {label} | {100 * summary['bc_success']:.0f} % | "
            f"{100 * summary['rl_success']:.0f} % | {summary['env_steps']:,} | "
            f"{summary['wall_seconds'] / 60:.1f} |"
        )
    axes[0][0].set(xlabel="environment steps", ylabel="success (%)", ylim=(-2, 102))
    if config.wall_time:
        axes[0][1].set(xlabel="wall time (min)", ylabel="success (%)", ylim=(-2, 102))
    for axis in axes[0]:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(config.title)
    figure.tight_layout()
    Path(config.output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(config.output, dpi=120)
    print(f"wrote {config.output}")


if __name__ == "__main__":
    main(parse_config(CompareConfig, description=__doc__))
