"""``benchmarks/profile_main_job.py``: every part of the main job measured beside its floor,
and the run's totals made of them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("env", "policy", "collection", "learner", "evaluation", "protocol", "pretrain_step")

# The floors that are a subset of the measured work: a ratio well below 1 means a broken
# floor or a broken measurement (the tolerance covers a loaded machine's noise).
TOLERANCE = 0.5


def test_the_profile_measures_every_part_beside_its_floor(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_main_job

    output = tmp_path / "profile.json"
    settings = ["--quick", "--max_episode_steps", "24", "--eval_episodes", "2"]
    settings += ["--held_out_episodes", "2", "--sampler.eval_num_denoising_steps", "4"]
    settings += ["--total_env_steps", "1000", "--eval_every", "2"]
    profile_main_job.main([*settings, "--rounds", "2", "--output", str(output)])
    result = json.loads(output.read_text())

    assert result["threads"] == 1 and result["rounds"] == 2
    # 4 envs x ceil(24 / 4) decisions; a batch of 96 env steps: 11 iterations for 1000.
    assert result["decisions_per_batch"] == 4 * 6 and result["env_steps_per_batch"] == 96
    assert result["stochastic_steps_per_decision"] == 2  # sde_mode last, num_sde_steps 2
    parts = result["parts"]
    assert set(parts) == set(PARTS)
    for name, part in parts.items():
        assert part["seconds"] > 0 and part["floor_seconds"] > 0, name
        assert part["seconds_q25"] <= part["seconds"] <= part["seconds_q75"], name
        assert part["ratio"] >= TOLERANCE, name
        assert part["run_seconds"] == pytest.approx(part["per_run"] * part["seconds"])
    assert parts["env"]["ratio"] > 1  # a TorchRL env wraps the raw MuJoCo steps
    iterations = math.ceil(1000 / 96)
    assert parts["collection"]["per_run"] == parts["learner"]["per_run"] == iterations
    assert parts["evaluation"]["per_run"] == iterations // 2 + 1 + 2  # the end, BC baselines
    assert parts["protocol"]["per_run"] == 1
    assert parts["pretrain_step"]["per_run"] == 150  # ppo.py's --quick pretraining
    total = sum(part["run_seconds"] for part in parts.values())
    assert result["run_total_seconds"] == pytest.approx(total)
    assert sum(part["run_share"] for part in parts.values()) == pytest.approx(1)
    floor = sum(part["run_floor_seconds"] for part in parts.values())
    assert result["run_floor_seconds"] == pytest.approx(floor)
