"""What a run's CSV log says, window by window: is the critic fitting, are the steps clipped,
is the policy drifting, do the batches succeed?

Reads the CSV log that ``examples/ppo.py`` (``--loggers csv``, the tests' and the
experiments' choice) writes under its ``output_dir`` and prints one Markdown table per run:
the run's env steps cut into ``--windows`` equal windows, each cell the mean of a logged
scalar over the rows inside the window (``n/a`` where the run logged none). The default
columns are the diagnostics of a PPO run that goes wrong: the batches' own success (the
rollout sampler, training states), the learning curve (the evaluation decoding, curve
states), the clip fraction and the approximate KL of the updates, the critic's explained
variance, the scale of GAE's advantage before the loss normalises it, and the self-imitation
loss. Any other logged scalar is a ``--metrics`` name (``--list_names`` prints them)::

    python examples/run_log.py --runs "defaults=outputs/ppo" --windows 4
    python examples/run_log.py --runs "a=outputs/run_a" "b=outputs/run_b" \\
        --metrics clip_fraction,kl_approx,loss/critic
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import fmean as mean

from torchrl_flowpolicy.training.loggers import read_csv_log

from common import option, parse_config
from run_settings import validate_config

#: The default columns: (logged name, header, digits).
DIAGNOSTICS = (
    ("train/episode_success", "batch success", 3),
    ("eval/success_rate", "curve success", 3),
    ("clip_fraction", "clip fraction", 3),
    ("kl_approx", "KL", 4),
    ("explained_variance", "explained variance", 3),
    ("train/advantage_std", "advantage std", 4),
    ("loss/bc", "self-imitation loss", 4),
)


@dataclass
class RunLogConfig:
    """Which runs and which scalars; every field is a command-line option."""

    runs: list[str] = option(help="the runs, each as LABEL=output_dir (a run's folder)")
    windows: int = option(4, "equal windows of env steps a table cuts the run into", minimum=1)
    metrics: str = option("", "comma-separated logged names (empty: the diagnostics above)")
    list_names: bool = option(False, "print each run's logged names instead of the tables")

    def option_conflicts(self) -> list[str]:
        """Options given without what reads them."""
        return ["--metrics: not with --list_names"] if self.metrics and self.list_names else []


def columns(metrics: str) -> list[tuple[str, str, int]]:
    """``(name, header, digits)`` of the table's columns: :data:`DIAGNOSTICS`, or the names
    of ``--metrics`` (headed by their names, 4 digits)."""
    if not metrics:
        return list(DIAGNOSTICS)
    return [(name.strip(), name.strip(), 4) for name in metrics.split(",") if name.strip()]


def window_table(log: dict[str, list[tuple[int, float]]], windows: int, names: list) -> list[str]:
    """The Markdown rows (header first) of ``log`` cut into ``windows`` windows of env steps,
    ``(start, end]`` over the largest step any scalar logged; each cell the mean of the rows
    of that scalar inside the window."""
    last = max((step for rows in log.values() for step, _ in rows), default=0)
    edges = [round(last * index / windows) for index in range(windows + 1)]
    lines = ["| env steps | " + " | ".join(header for _, header, _ in names) + " |"]
    lines.append("| --- " * (len(names) + 1) + "|")
    for start, end in zip(edges[:-1], edges[1:], strict=True):
        cells = []
        for name, _, digits in names:
            inside = [value for step, value in log.get(name, []) if start < step <= end]
            cells.append(f"{mean(inside):.{digits}f}" if inside else "n/a")
        lines.append(f"| {start:,}-{end:,} | " + " | ".join(cells) + " |")
    return lines


def main(config: RunLogConfig) -> dict[str, list[str]]:
    validate_config(config)
    logs = {}
    for specification in config.runs:
        label, _, folder = specification.rpartition("=")
        if not label or not folder:
            raise ValueError(f"--runs: expected LABEL=output_dir, got {specification!r}.")
        logs[label] = (folder, read_csv_log(Path(folder)))
    # A --metrics name no run logged is a typo; one that some runs lack is n/a in theirs (a
    # run without self-imitation logs no loss/bc).
    names = columns(config.metrics)
    logged = {name for _, log in logs.values() for name in log}
    missing = [name for name, _, _ in names if name not in logged]
    if config.metrics and missing and not config.list_names:
        folders = ", ".join(folder for folder, _ in logs.values())
        raise ValueError(
            f"no run logged {missing} ({folders}); they logged: {', '.join(sorted(logged))}."
        )
    tables = {}
    for label, (folder, log) in logs.items():
        print(f"\n{label} ({folder})")
        if config.list_names:
            print(", ".join(log))
            continue
        tables[label] = window_table(log, config.windows, names)
        print("\n".join(tables[label]))
    return tables


if __name__ == "__main__":
    main(parse_config(RunLogConfig, description=__doc__))
