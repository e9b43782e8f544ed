"""End-to-end runs of the examples at a tiny budget (marked ``slow``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrl_flowpolicy.networks import ObservationNormalizer

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


@pytest.mark.slow
def test_evaluate_checkpoints_at_several_noise_scales(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from common import OBSERVATION_DIM, ModelConfig, build_policy, save_policy

        torch.manual_seed(0)
        model_config = ModelConfig(model_dim=16, num_heads=2, num_layers=1)
        normalizer = ObservationNormalizer(
            torch.zeros(OBSERVATION_DIM), torch.ones(OBSERVATION_DIM)
        )
        save_policy(tmp_path / "policy.pt", build_policy(model_config, normalizer), model_config)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    output = tmp_path / "evaluation.json"
    command = [
        sys.executable,
        str(ROOT / "examples" / "evaluate.py"),
        "--checkpoints", f"{tmp_path / 'policy.pt'},{tmp_path / 'policy.pt'}",
        "--eval_noise_scales", "1.0,0.0",
        "--eval_episodes", "3",
        "--max_episode_steps", "12",
        "--eval_num_denoising_steps", "2",
        "--output_json", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(output.read_text())["rows"]
    assert [row["eval_noise_scale"] for row in rows] == [1.0, 0.0, 1.0, 0.0]
    assert all(row["num_episodes"] == 3 for row in rows)
    # Same checkpoint, same seed: the same episodes; the two scales give different returns.
    assert rows[0]["mean_return"] == rows[2]["mean_return"]
    assert rows[1]["mean_return"] == rows[3]["mean_return"]
    assert rows[0]["mean_return"] != rows[1]["mean_return"]
    assert "scale 0: success" in result.stdout
