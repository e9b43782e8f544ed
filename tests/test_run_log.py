"""examples/run_log.py and training.loggers.read_csv_log: a run's CSV log, window by window."""

from __future__ import annotations

import pytest
from examples_loader import load_example

from torchrl_flowpolicy.training.loggers import MetricLogger, read_csv_log


def write_log(folder, rows: dict[int, dict[str, float]]) -> None:
    logger = MetricLogger("csv", "ppo_seed0", folder, {})
    for step, values in rows.items():
        logger.log(values, step=step)


def test_read_csv_log_returns_every_scalar_in_order(tmp_path):
    write_log(tmp_path, {100: {"clip_fraction": 0.5, "train/episode_success": 0.25},
                         200: {"clip_fraction": 0.25}})  # fmt: skip
    assert read_csv_log(tmp_path) == {
        "clip_fraction": [(100, 0.5), (200, 0.25)],
        "train/episode_success": [(100, 0.25)],
    }
    with pytest.raises(FileNotFoundError, match="no CSV log.*--loggers csv"):
        read_csv_log(tmp_path / "elsewhere")
    MetricLogger("csv", "ppo_seed1", tmp_path, {}).log({"x": 1.0}, step=1)
    with pytest.raises(FileNotFoundError, match="2 CSV logs"):
        read_csv_log(tmp_path)


def test_window_means_cut_the_env_steps_into_equal_windows():
    run_log = load_example("run_log")
    log = {"clip_fraction": [(100, 0.1), (200, 0.3), (300, 0.5), (400, 0.7)],
           "kl_approx": [(400, 0.02)]}  # fmt: skip
    names = [("clip_fraction", "clip", 2), ("kl_approx", "KL", 3), ("loss/bc", "bc", 2)]
    lines = run_log.window_table(log, 2, names)
    assert lines[0] == "| env steps | clip | KL | bc |"
    # (0, 200]: 0.1 and 0.3; (200, 400]: 0.5 and 0.7; a scalar absent from a window: n/a.
    assert lines[2:] == ["| 0-200 | 0.20 | n/a | n/a |", "| 200-400 | 0.60 | 0.020 | n/a |"]


def test_run_log_prints_the_diagnostics_and_refuses_unlogged_names(tmp_path, capsys):
    run_log = load_example("run_log")
    write_log(tmp_path, {step: {"clip_fraction": step / 1000, "explained_variance": 0.9}
                         for step in (100, 200, 300)})  # fmt: skip
    tables = run_log.main(run_log.RunLogConfig(runs=[f"run={tmp_path}"], windows=3))
    header = tables["run"][0]
    assert "clip fraction" in header and "explained variance" in header
    assert tables["run"][2].startswith("| 0-100 | n/a | n/a | 0.100 | n/a | 0.900 |")
    assert "| 200-300 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"no run logged \['loss/critic'\] .*: clip_fraction, exp"):
        run_log.main(run_log.RunLogConfig(runs=[f"run={tmp_path}"], metrics="loss/critic"))
    # A name that one run logged and another did not: n/a in the other's table.
    other = tmp_path / "other"
    write_log(other, {300: {"loss/critic": 0.5}})
    tables = run_log.main(run_log.RunLogConfig(
        runs=[f"run={tmp_path}", f"other={other}"], windows=1, metrics="clip_fraction,loss/critic"
    ))  # fmt: skip
    assert tables["run"][2] == "| 0-300 | 0.2000 | n/a |"
    assert tables["other"][2] == "| 0-300 | n/a | 0.5000 |"
    with pytest.raises(ValueError, match="LABEL=output_dir"):
        run_log.main(run_log.RunLogConfig(runs=[str(tmp_path)]))
