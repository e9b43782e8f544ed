"""Same seed, same numbers: two runs of an example from the same pretrained checkpoint agree.

Both examples seed torch and their training environments; the collector resets its
environment when it is built, so the environment is seeded before that. The runs are
compared on their evaluation history and on the logged training reward of every batch.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(arguments: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, *arguments], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pretrain")
    run(
        [
            str(ROOT / "examples" / "pretrain.py"),
            "--demo_episodes", "12",
            "--train_steps", "100",
            "--eval_episodes", "4",
            "--output_dir", str(directory),
            "--demo_dir", str(directory / "demos"),
        ]
    )  # fmt: skip
    return directory / "policy.pt"


def csv_column(path: Path) -> list[tuple[str, str]]:
    with path.open() as file:
        return [tuple(row) for row in csv.reader(file)]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo.py", "dsrl.py"])
def test_two_runs_with_the_same_seed_agree(tmp_path, pretrained, script):
    summaries, rewards = [], []
    for name in ("first", "second"):
        output = tmp_path / name
        run(
            [
                str(ROOT / "examples" / script),
                "--quick",
                "--seed", "3",
                "--total_env_steps", "1200",
                "--eval_episodes", "4",
                "--loggers", "csv",
                "--output_dir", str(output),
                "--pretrained_checkpoint", str(pretrained),
            ]
        )  # fmt: skip
        summaries.append(json.loads((output / "summary.json").read_text()))
        experiment = f"{script.removesuffix('.py')}_seed3"
        rewards.append(
            csv_column(output / "csv" / experiment / "scalars" / "train" / "chunk_reward.csv")
        )
    first, second = summaries
    assert len(rewards[0]) >= 2
    assert rewards[0] == rewards[1]
    keys = ("env_steps", "success_rate", "mean_return")
    assert [[row[key] for key in keys] for row in first["history"]] == [
        [row[key] for key in keys] for row in second["history"]
    ]
    assert first["rl_return"] == second["rl_return"]
