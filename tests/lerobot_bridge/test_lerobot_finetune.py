"""``examples/lerobot_finetune.py --quick`` end to end: LeRobot's BC, PPO through the bridge,
the held-out protocol, LeRobot's save / reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lerobot")
pytest.importorskip("mujoco")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_finetune_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # it imports common, as the script
    import lerobot_finetune

    config = lerobot_finetune.parse_config(
        lerobot_finetune.FinetuneConfig,
        ["--quick", "--output_dir", str(tmp_path)],
        quick=lerobot_finetune.QUICK,
    )
    result = lerobot_finetune.main(config)
    protocol = result["protocol"]
    assert protocol["num_episodes"] == config.held_out_episodes
    for who in ("bc", "rl"):
        assert set(protocol["success"][who]) == {"sampled", "noise_free"}
    assert set(protocol["rl_minus_bc_best"]) == {"sampled", "noise_free"}
    assert 0 <= protocol["success"]["expert"]["rate"] <= 1
    assert len(result["history"]) == config.iterations
    # The rollout's log-probs rescore in the learner before any update (float rounding only).
    assert all(row["log_prob_drift_before_update"] < 1e-4 for row in result["history"])
    # LeRobot's own reload of the saved checkpoint samples the bridge's chunk.
    assert result["reload_max_abs_error"] < 1e-5
    checkpoint = tmp_path / "lerobot_policy"
    assert (checkpoint / "config.json").exists() and (checkpoint / "model.safetensors").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["protocol"] == protocol


@pytest.mark.parametrize("result", ["summary.json", "lerobot_policy"])
def test_finetune_refuses_a_folder_holding_another_runs_results(result, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import lerobot_finetune

    class Stop(Exception):
        """The run got past the output check."""

    def stop(*args, **kwargs):
        raise Stop

    (tmp_path / result).mkdir() if result == "lerobot_policy" else (tmp_path / result).touch()
    config = lerobot_finetune.FinetuneConfig(output_dir=str(tmp_path))
    monkeypatch.setattr(lerobot_finetune, "get_task", stop)  # the run's first work
    with pytest.raises(FileExistsError, match=f"{result}.*--overwrite"):
        lerobot_finetune.main(config)
    with pytest.raises(Stop):  # --overwrite: on to the work
        lerobot_finetune.main(
            lerobot_finetune.FinetuneConfig(output_dir=str(tmp_path), overwrite=True)
        )
