"""The main job end to end at a tiny budget: demos -> pretraining -> PPO -> evaluation -> plot.

Runs ``examples/ppo.py --quick`` as a user would (a subprocess from the repository root),
kills it once it has written its first checkpoint, resumes it, and checks that the resumed run
continued from the saved iteration and wrote its summary, plot and checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchrl_flowpolicy.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def command(output: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "examples" / "ppo.py"),
        "--quick",
        "--loggers",
        "csv",
        "--output_dir",
        str(output / "ppo"),
        "--pretrained_checkpoint",
        str(output / "pretrain" / "policy.pt"),
        "--pretrain.demo_dir",
        str(output / "demos"),
        *extra,
    ]


@pytest.mark.slow
def test_quick_run_is_killed_then_resumed(tmp_path, check_protocol_fields):
    environment = {**os.environ, "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}
    checkpoint = tmp_path / "ppo" / "checkpoint.pt"
    process = subprocess.Popen(
        command(tmp_path),
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    process.kill()
    output, _ = process.communicate()
    assert checkpoint.exists(), f"no checkpoint was written:\n{output[-3000:]}"
    saved_iteration = load_checkpoint(checkpoint)["iteration"]
    assert saved_iteration >= 1

    resumed = subprocess.run(
        command(tmp_path, "--resume"),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    match = re.search(r"resumed from iteration (\d+)", resumed.stdout)
    assert match is not None, resumed.stdout[-3000:]
    assert int(match.group(1)) == saved_iteration

    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    total_iterations = summary["config"]["total_env_steps"] // (
        summary["config"]["num_envs"] * summary["config"]["max_episode_steps"]
    )
    assert summary["iterations"] == total_iterations
    assert summary["env_steps"] == total_iterations * 4 * 150
    assert 0.0 <= summary["bc_success"] <= 1.0 and 0.0 <= summary["rl_success"] <= 1.0
    assert "BC success" in resumed.stdout and "RL success" in resumed.stdout
    check_protocol_fields(summary, resumed.stdout, "PPO", "noise_free")  # the default
    plot = tmp_path / "ppo" / "learning_curve.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = load_checkpoint(checkpoint)
    assert state["iteration"] == total_iterations
    assert all(torch.isfinite(value).all() for value in state["policy"].values())
    assert (tmp_path / "pretrain" / "policy.pt").exists()


@pytest.mark.slow
def test_quick_run_with_two_collector_processes(tmp_path, check_protocol_fields):
    # TorchRL's MultiSyncCollector: 2 workers x 2 envs, the weights synced after every update;
    # the batches and the env-step count are those of one process with 4 envs.
    environment = {**os.environ, "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}
    result = subprocess.run(
        command(tmp_path, "--collector_workers", "2"),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    assert summary["config"]["collector_workers"] == 2
    assert summary["env_steps"] == summary["config"]["total_env_steps"]
    check_protocol_fields(summary, result.stdout, "PPO", "noise_free")


@pytest.mark.slow
def test_quick_lift_chain(tmp_path, check_protocol_fields):
    # robosuite Lift through the same script: demonstrations, pretraining, PPO, evaluation
    # in rounds of at most max_eval_envs simulators, the held-out protocol with the expert.
    pytest.importorskip("robosuite")
    environment = {**os.environ, "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}
    result = subprocess.run(
        command(
            tmp_path, "--task", "lift", "--pretrain.demo_episodes", "3", "--minibatch_size", "30"
        ),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    assert summary["config"]["task"] == "lift"
    assert summary["config"]["max_episode_steps"] == 60
    assert summary["pretrained"]["config"]["model"]["observation_dim"] == 60
    assert summary["env_steps"] >= summary["config"]["total_env_steps"]
    check_protocol_fields(summary, result.stdout, "PPO", "noise_free")
    assert summary["held_out"]["success"]["expert"]["rate"] > 0.5
    assert (tmp_path / "demos" / "lift_T60_action_noise0.3_n3_seed0.pt").exists()


@pytest.mark.slow
def test_quick_grpo_run_without_a_critic_then_resumed(tmp_path, check_protocol_fields):
    # --advantage grpo: 2 groups of 2 environments, no critic; two iterations, then one more
    # after --resume (the checkpoint holds no critic).
    environment = {**os.environ, "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}
    grpo = ("--advantage", "grpo", "--eval_every", "1")
    first = subprocess.run(
        command(tmp_path, *grpo, "--total_env_steps", "1200"),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    state = load_checkpoint(tmp_path / "ppo" / "checkpoint.pt")
    assert state["advantage"] == "grpo" and "critic" not in state and state["iteration"] == 2

    resumed = subprocess.run(
        command(tmp_path, *grpo, "--total_env_steps", "1800", "--resume"),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from iteration 2" in resumed.stdout
    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    assert (summary["config"]["advantage"], summary["config"]["group_size"]) == ("grpo", 2)
    assert summary["env_steps"] == 1800 and summary["iterations"] == 3
    assert [row["iteration"] for row in summary["history"]] == [1, 2, 3]
    check_protocol_fields(summary, resumed.stdout, "PPO", "noise_free")
    (scalars,) = (tmp_path / "ppo" / "csv").glob("*/scalars")
    for name in ("zero_std_groups", "kept_decisions", "episode_return", "group_return_std"):
        rows = (scalars / "grpo" / f"{name}.csv").read_text().split()
        assert len(rows) == 3, name
    kept = (scalars / "grpo" / "kept_decisions.csv").read_text().split()
    assert [row.split(",")[1] for row in kept] == ["1.0"] * 3  # Pusher: no episode ends early
    assert not (scalars / "loss" / "critic.csv").exists()
    assert not (scalars / "explained_variance.csv").exists()


@pytest.mark.slow
def test_quick_run_with_learned_noise_saves_and_resumes_the_head(tmp_path, check_protocol_fields):
    # --noise learned: a fresh noise head on the pretrained policy, trained (with an entropy
    # bonus), saved in the run checkpoint; a --resume continues with it.
    environment = {**os.environ, "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}
    learned = ["--noise", "learned", "--entropy_coeff", "0.01"]
    first = subprocess.run(
        command(tmp_path, *learned, "--total_env_steps", "1200"),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    checkpoint = tmp_path / "ppo" / "checkpoint.pt"
    saved = load_checkpoint(checkpoint)
    assert saved["noise"] == {"kind": "learned", "min_std": 0.02, "max_std": 0.3}
    head = {name: value for name, value in saved["policy"].items() if "noise_head." in name}
    assert head and all(torch.isfinite(value).all() for value in head.values())
    # The output layer starts at zero: the actor update (iteration 2) has moved it.
    assert head["noise_head.mlp.4.weight"].abs().sum() > 0

    resumed = subprocess.run(
        command(tmp_path, *learned, "--resume"),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from iteration 2" in resumed.stdout
    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    assert summary["config"]["noise"] == "learned" and summary["iterations"] == 4
    check_protocol_fields(summary, resumed.stdout, "PPO", "noise_free")
    final = load_checkpoint(checkpoint)
    assert final["iteration"] == 4
    assert not torch.equal(
        final["policy"]["noise_head.mlp.4.weight"], head["noise_head.mlp.4.weight"]
    )
    noise_std = tmp_path / "ppo" / "csv" / "ppo_seed0" / "scalars" / "train" / "noise_std.csv"
    rows = [line.split(",") for line in noise_std.read_text().split()]
    assert len(rows) == 4 and all(0.02 <= float(value) <= 0.3 for _, value in rows)
