"""End-to-end runs of the examples at a tiny budget (marked ``slow``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--num-envs", "2",
    "--frames-per-batch", "8",
    "--total-decisions", "16",
    "--model-dim", "16",
    "--num-heads", "2",
    "--num-layers", "1",
    "--eval-num-steps", "4",
    "--eval-max-decisions", "3",
]  # fmt: skip


def run_sampler_demo(tmp_path: Path, *options: str) -> tuple[str, dict]:
    command = [sys.executable, str(ROOT / "examples" / "sampler_demo.py"), *TINY, *options]
    command += ["--output-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.slow
def test_sampler_demo_mixed(tmp_path):
    stdout, summary = run_sampler_demo(tmp_path)

    # Pusher-v5 episodes last 100 steps = 25 decisions of 4 rows: no episode ends here.
    assert summary["decisions"] == 16
    assert summary["env_steps"] == 16 * 4
    assert len(summary["batches"]) == 2
    # "mixed": exactly one stochastic step per decision, never step 0.
    counts = [row["count"] for row in summary["stochastic_step_histogram"]]
    assert len(counts) == 8 and counts[0] == 0 and sum(counts) == 16
    # The learner's recomputation matches what the rollout stored.
    assert summary["recompute_max_abs_diff"] < 1e-3
    for value in summary["log_prob"].values():
        assert value == value and abs(value) < 1e4  # finite
    evaluation = summary["evaluation"]
    assert evaluation["decisions"] == 3 and evaluation["env_steps"] == 12
    assert evaluation["num_steps"] == 4
    assert "evaluation (deterministic ODE, K=4)" in stdout
    assert "stochastic steps (sde_mode=mixed, K=8)" in stdout


@pytest.mark.slow
def test_sampler_demo_last_steps(tmp_path):
    _, summary = run_sampler_demo(tmp_path, "--sde-mode", "last", "--num-sde-steps", "2")

    counts = [row["count"] for row in summary["stochastic_step_histogram"]]
    assert counts == [0] * 6 + [16, 16]
    assert summary["recompute_max_abs_diff"] < 1e-3
