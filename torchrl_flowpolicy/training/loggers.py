"""A run's metric log: TorchRL's loggers behind one call, and the CSV files of a resumed run.

:class:`MetricLogger` writes every metric to the TorchRL loggers a run names
(:class:`~torchrl.record.loggers.CSVLogger`, :class:`~torchrl.record.loggers.WandbLogger`
offline). For an exact resume, the CSV files must end up holding the rows of an
uninterrupted run: the rows the killed run logged after its last checkpoint, which the
resumed run logs again, are removed when it starts (:func:`drop_rows_after`, the one place
that edits a logger's files). wandb writes a new offline run for the resumed one.
:class:`MetricWindow` gathers the training metrics and timings between two logged rows.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> directory = Path(tempfile.mkdtemp())
    >>> logger = MetricLogger("csv", "ppo_seed0", directory, {"seed": 0})
    >>> logger.log({"train/reward": 0.5}, step=600)
    >>> (directory / "csv" / "ppo_seed0" / "scalars" / "train" / "reward.csv").read_text()
    '600,0.5\\n'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrl.record.loggers import CSVLogger, Logger, WandbLogger

from torchrl_flowpolicy.training.checkpoint import atomic_write

__all__ = [
    "LOGGERS",
    "MetricLogger",
    "MetricWindow",
    "drop_rows_after",
    "read_csv_log",
    "unknown_loggers",
]

#: The TorchRL loggers a run may name (:class:`MetricLogger`).
LOGGERS = ("wandb", "csv")


def unknown_loggers(names: str) -> list[str]:
    """The names of the comma-separated ``names`` that are not :data:`LOGGERS` (blanks
    around a name and empty items ignored): what a run refuses before any work.

    Example:
        >>> unknown_loggers("csv, tensorboard,")
        ['tensorboard']
    """
    items = (part.strip() for part in names.split(","))
    return [name for name in items if name and name not in LOGGERS]


class MetricLogger:
    """The TorchRL loggers named in ``names`` (comma-separated: ``"wandb"`` runs offline,
    ``"csv"``) behind one :meth:`log`.

    Args:
        names: e.g. ``"wandb,csv"``; an empty string logs nothing.
        experiment: the run's name (the CSV logger's folder, wandb's run name).
        output_dir: where the loggers write (``output_dir / "csv"``, wandb's files).
        config: the run's settings (a dataclass or a mapping), given to wandb.
        resume_step: the logged step of the checkpoint a resumed run starts from: the CSV
            rows logged after it are removed first (:func:`drop_rows_after`).

    Raises:
        ValueError: an unknown logger name.
    """

    def __init__(
        self,
        names: str,
        experiment: str,
        output_dir: str | Path,
        config: Any,
        resume_step: int | None = None,
    ):
        output_dir = Path(output_dir)
        settings = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
        self.loggers: list[Logger] = []
        for name in filter(None, names.split(",")):
            if name == "wandb":
                self.loggers.append(
                    WandbLogger(
                        experiment,
                        offline=True,
                        save_dir=str(output_dir),
                        project="torchrl_flowpolicy",
                        config=dict(settings),
                    )
                )
            elif name == "csv":
                directory = output_dir / "csv"
                if resume_step is not None:
                    drop_rows_after(directory / experiment / "scalars", resume_step)
                self.loggers.append(CSVLogger(experiment, log_dir=str(directory)))
            else:
                raise ValueError(f"unknown logger {name!r}: use 'wandb' and/or 'csv'.")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Every metric at ``step`` to every logger."""
        for logger in self.loggers:
            for name, value in metrics.items():
                logger.log_scalar(name, value, step=step)


@dataclass
class MetricWindow:
    """Training metrics and timings gathered between two logged rows (or over one update
    round): every value :meth:`add` received, averaged by :meth:`means`.

    Example:
        >>> window = MetricWindow(collect_seconds=2.0, env_steps=600)
        >>> window.add("loss_actor", 1.0)
        >>> window.add("loss_actor", 3.0)
        >>> window.row(updates=10)
        {'loss/actor': 2.0, 'perf/env_steps_per_second': 300.0, 'updates': 10}
    """

    metrics: dict[str, list[float]] = field(default_factory=dict)
    collect_seconds: float = 0.0
    update_seconds: float = 0.0
    env_steps: int = 0
    updates: int = 0

    def add(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(value)

    def means(self) -> dict[str, float]:
        """The mean of every metric's values, in the order the metrics first came."""
        return {name: sum(values) / len(values) for name, values in self.metrics.items()}

    def row(self, updates: int) -> dict[str, float]:
        """The means, the throughput and the update count, with ``loss_*`` as ``loss/*``."""
        row = self.means()
        row["perf/env_steps_per_second"] = self.env_steps / max(self.collect_seconds, 1e-9)
        if self.updates:
            row["perf/updates_per_second"] = self.updates / max(self.update_seconds, 1e-9)
        row["updates"] = updates
        return {name.replace("loss_", "loss/"): value for name, value in row.items()}


def drop_rows_after(scalars: str | Path, step: int) -> list[Path]:
    """Remove the rows logged after ``step`` from the CSV logger's files under ``scalars``.

    Each file holds one ``step,value`` line per logged value. A last line without its line
    break (a write cut short by a kill) is removed too. Files are rewritten atomically.

    Returns:
        The files that changed.
    """
    changed = []
    for path in sorted(Path(scalars).rglob("*.csv")):
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.endswith("\n") and int(line.split(",")[0]) <= step]
        if kept != lines:
            atomic_write(path, lambda file, kept=kept: file.write("".join(kept).encode()))
            changed.append(path)
    return changed


def read_csv_log(output_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a run's CSV logger wrote under ``output_dir``: ``{name: [(step, value),
    ...]}`` in the order logged, named as logged (``"clip_fraction"``, ``"train/episode_success"``).

    Raises:
        FileNotFoundError: ``output_dir`` holds no CSV log (the run was made without
            ``--loggers csv``); a folder with several runs' logs is refused too.

    Example:
        >>> import tempfile
        >>> directory = Path(tempfile.mkdtemp())
        >>> MetricLogger("csv", "ppo_seed0", directory, {}).log({"train/reward": 0.5}, step=600)
        >>> read_csv_log(directory)
        {'train/reward': [(600, 0.5)]}
    """
    folders = sorted(Path(output_dir).glob("csv/*/scalars"))
    if len(folders) != 1:
        found = "no CSV log" if not folders else f"{len(folders)} CSV logs"
        raise FileNotFoundError(
            f"{output_dir}: {found} (expected one csv/<experiment>/scalars folder: a run made "
            "with --loggers csv)."
        )
    log = {}
    for path in sorted(folders[0].rglob("*.csv")):
        rows = (line.split(",") for line in path.read_text().splitlines() if line)
        name = path.relative_to(folders[0]).with_suffix("").as_posix()
        log[name] = [(int(step), float(value)) for step, value in rows]
    return log
