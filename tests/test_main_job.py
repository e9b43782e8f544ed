"""The main job end to end at a tiny budget: demos -> pretraining -> PPO -> evaluation -> plot.

Runs ``examples/ppo.py --quick`` as a user would (a subprocess from the repository root).
The first test kills a run with ``SIGKILL`` at a random moment after its first checkpoint,
resumes it, and checks that the resumed run logged exactly the numbers of an uninterrupted
run of the same seed, and wrote the same summary, final checkpoint and plot.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrl_flowpolicy.training.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ENVIRONMENT = {**os.environ, "WANDB_MODE": "offline", "MUJOCO_GL": "egl", "OMP_NUM_THREADS": "1"}


def command(output: Path, *extra: str, pretrained: Path | None = None) -> list[str]:
    """``ppo.py --quick`` writing into ``output`` (its pretrained checkpoint too, unless
    ``pretrained`` names one)."""
    return [
        sys.executable,
        str(ROOT / "examples" / "ppo.py"),
        "--quick",
        "--loggers",
        "csv",
        "--output_dir",
        str(output / "ppo"),
        "--pretrained_checkpoint",
        str(pretrained or output / "pretrain" / "policy.pt"),
        "--pretrain_if_missing",
        "--pretrain.demo_dir",
        str(output / "demos"),
        *extra,
    ]


def run(arguments: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(
        arguments, cwd=ROOT, env=ENVIRONMENT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def logged_scalars(output_dir: Path) -> dict[str, list[str]]:
    """Every scalar the CSV logger wrote, ``{file: its "step,value" lines}``, except the
    wall-clock timings (``time/*``)."""
    scalars = output_dir / "csv" / "ppo_seed0" / "scalars"
    return {
        str(path.relative_to(scalars)): path.read_text().splitlines()
        for path in sorted(scalars.rglob("*.csv"))
        if path.parent.name != "time"
    }


def without_timings(value: Any) -> Any:
    """``value`` (a JSON document) without its wall-clock entries (keys ending in "seconds")."""
    if isinstance(value, dict):
        return {
            key: without_timings(item) for key, item in value.items() if not key.endswith("seconds")
        }
    if isinstance(value, list):
        return [without_timings(item) for item in value]
    return value


def flat_state(state: Any, prefix: str = "") -> dict[str, Any]:
    """A checkpoint entry as ``{dotted key: leaf}`` (tensors and plain values)."""
    if isinstance(state, dict):
        return {
            name: leaf
            for key, item in state.items()
            for name, leaf in flat_state(item, f"{prefix}{key}.").items()
        }
    return {prefix.rstrip("."): state}


@pytest.mark.slow
def test_a_run_killed_at_a_random_moment_and_resumed_logs_the_uninterrupted_numbers(
    tmp_path, check_protocol_fields
):
    # 8 PPO iterations, a checkpoint every 2: the kill lands after the first checkpoint
    # and (almost always) before the last, so that the resumed run trains.
    budget = ["--total_env_steps", str(8 * 4 * 150)]
    # One pretraining for both runs (a run that pretrains draws from torch's stream first).
    run(
        [
            sys.executable,
            str(ROOT / "examples" / "pretrain.py"),
            "--demo_episodes", "5",
            "--train_steps", "100",
            "--eval_episodes", "4",
            "--output_dir", str(tmp_path / "pretrain"),
            "--demo_dir", str(tmp_path / "demos"),
        ]
    )  # fmt: skip
    options = {"pretrained": tmp_path / "pretrain" / "policy.pt"}
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    run(command(uninterrupted, *budget, **options))

    checkpoint = interrupted / "ppo" / "checkpoint.pt"
    log = tmp_path / "killed.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            command(interrupted, *budget, **options),
            cwd=ROOT,
            env=ENVIRONMENT,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 600
        while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checkpoint.exists(), f"no checkpoint was written:\n{log.read_text()[-3000:]}"
        delay = random.uniform(0.0, 1.0)  # about one PPO iteration
        time.sleep(delay)
        running = process.poll() is None
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert running, f"the run ended before the kill ({delay:.2f} s after its first checkpoint)"
    assert process.returncode == -signal.SIGKILL
    killed_at = load_checkpoint(checkpoint)
    saved_iteration, saved_wall_seconds = killed_at["iteration"], killed_at["wall_seconds"]
    assert 2 <= saved_iteration and not (interrupted / "ppo" / "summary.json").exists()

    resumed = run(command(interrupted, *budget, "--resume", **options))
    match = re.search(r"resumed from iteration (\d+)", resumed.stdout)
    assert match is not None and int(match.group(1)) == saved_iteration, resumed.stdout[-3000:]
    note = f"(killed {delay:.2f} s after the first checkpoint, resumed from {saved_iteration})"

    # The evaluation history and every other number of the summary, the protocol included.
    expected = json.loads((uninterrupted / "ppo" / "summary.json").read_text())
    summary = json.loads((interrupted / "ppo" / "summary.json").read_text())
    for document in (expected, summary):  # the config less the paths and --resume
        config = document["config"]
        del config["output_dir"], config["resume"], config["pretrain"]["demo_dir"]
    assert without_timings(summary["history"]) == without_timings(expected["history"]), note
    assert without_timings(summary) == without_timings(expected), note
    # The clock goes on from the checkpoint's: the curve's wall times never go back.
    # (The last row, the final evaluation, is the resumed process's.)
    walls = [row["wall_seconds"] for row in summary["history"]]
    assert walls == sorted(walls) and walls[-1] > saved_wall_seconds, (walls, note)
    assert summary["wall_seconds"] >= walls[-1], note
    # Every logged training number (losses, diagnostics, training and evaluation metrics).
    logged = logged_scalars(interrupted / "ppo")
    assert logged == logged_scalars(uninterrupted / "ppo"), note
    assert len(logged["train/chunk_reward.csv"]) == 8
    # The final weights and optimiser states, bit for bit.
    final = flat_state(load_checkpoint(checkpoint))
    reference = flat_state(load_checkpoint(uninterrupted / "ppo" / "checkpoint.pt"))
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(final[name], value), f"{name} differs {note}"
        elif name not in ("history", "wall_seconds"):  # the timings, compared above
            assert final[name] == value, f"{name} differs {note}"

    assert summary["iterations"] == 8 and summary["env_steps"] == 8 * 4 * 150
    check_protocol_fields(summary, resumed.stdout, "PPO", "noise_free")  # the default
    plot = interrupted / "ppo" / "learning_curve.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_run_with_two_collector_processes(tmp_path, check_protocol_fields):
    # TorchRL's MultiSyncCollector: 2 workers x 2 envs, the weights synced after every update;
    # the batches and the env-step count are those of one process with 4 envs. The final
    # protocol on the validation states (--split validation: what settings are chosen on).
    result = run(command(tmp_path, "--collector_workers", "2", "--split", "validation"))
    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    assert summary["config"]["collector_workers"] == 2
    assert summary["env_steps"] == summary["config"]["total_env_steps"]
    check_protocol_fields(summary, result.stdout, "PPO", "noise_free", split="validation")


@pytest.mark.slow
def test_quick_lift_chain(tmp_path, check_protocol_fields):
    # robosuite Lift through the same script: demonstrations, pretraining, PPO, evaluation
    # in rounds of at most max_eval_envs simulators, the held-out protocol with the expert.
    pytest.importorskip("robosuite")
    # Kept short (robosuite's simulators are slow to build and step): 4 iterations, curve
    # evaluations of 4 episodes; the held-out protocol keeps --quick's 8 episodes.
    short = ["--total_env_steps", "960", "--eval_episodes", "4", "--pretrain.eval_episodes", "4"]
    result = run(
        command(
            tmp_path,
            "--task",
            "lift",
            "--pretrain.demo_episodes",
            "3",
            "--minibatch_size",
            "30",
            *short,
        )
    )
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
    grpo = ("--advantage", "grpo", "--eval_every", "1")
    run(command(tmp_path, *grpo, "--total_env_steps", "1200"))
    state = load_checkpoint(tmp_path / "ppo" / "checkpoint.pt")
    assert state["advantage"] == "grpo" and "critic" not in state and state["iteration"] == 2

    resumed = run(command(tmp_path, *grpo, "--total_env_steps", "1800", "--resume"))
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
    # bonus), saved in the run checkpoint; a --resume continues with it, its budget's last
    # 1,200 env steps (iterations 3 and 4) decaying both actor learning rates to 0.
    learned = ["--noise", "learned", "--entropy_coeff", "0.01"]
    run(command(tmp_path, *learned, "--total_env_steps", "1200"))
    checkpoint = tmp_path / "ppo" / "checkpoint.pt"
    saved = load_checkpoint(checkpoint)
    assert saved["noise"] == {"kind": "learned", "min_std": 0.02, "max_std": 0.3}
    head = {name: value for name, value in saved["policy"].items() if "noise_head." in name}
    assert head and all(torch.isfinite(value).all() for value in head.values())
    # The output layer starts at zero: the actor update (iteration 2) has moved it.
    assert head["sampler.noise_head.mlp.4.weight"].abs().sum() > 0

    decay = ["--actor_learning_rate_decay_env_steps", "1200"]
    resumed = run(command(tmp_path, *learned, *decay, "--resume"))
    assert "resumed from iteration 2" in resumed.stdout
    summary = json.loads((tmp_path / "ppo" / "summary.json").read_text())
    assert summary["config"]["noise"] == "learned" and summary["iterations"] == 4
    check_protocol_fields(summary, resumed.stdout, "PPO", "noise_free")
    final = load_checkpoint(checkpoint)
    assert final["iteration"] == 4
    assert not torch.equal(
        final["policy"]["sampler.noise_head.mlp.4.weight"], head["sampler.noise_head.mlp.4.weight"]
    )
    noise_std = tmp_path / "ppo" / "csv" / "ppo_seed0" / "scalars" / "train" / "noise_std.csv"
    rows = [line.split(",") for line in noise_std.read_text().split()]
    assert len(rows) == 4 and all(0.02 <= float(value) <= 0.3 for _, value in rows)
    # Each iteration's rates from the env steps before its batch (0, 600, 1200, 1800 of 2400).
    rates = noise_std.parent / "actor_learning_rate.csv"
    logged = [float(line.split(",")[1]) for line in rates.read_text().split()]
    assert logged == pytest.approx([1e-4, 1e-4, 1e-4, 0.5e-4])
    groups = final["actor_optimizer"]["param_groups"]  # the flow's, then the head's
    assert [group["lr"] for group in groups] == pytest.approx([0.5e-4, 1.5e-4])
