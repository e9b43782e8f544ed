"""``benchmarks/bench_lerobot.py --quick``: every arm runs, and the stored bytes are the
cache's size (layers x key/value heads x prefix tokens x head_dim) plus the chain."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_lerobot():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_lerobot

        yield bench_lerobot
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_quick_benchmark_measures_every_arm(bench_lerobot, tmp_path):
    output = tmp_path / "bench.json"
    rows = bench_lerobot.main(["--quick", "--rounds", "2", "--output", str(output)])
    assert [row["model"] for row in rows] == ["smolvla", "pi0"]
    saved = json.loads(output.read_text())
    assert saved["settings"]["quick"] and "load average" in saved["settings"]["load_before"]
    sizes = bench_lerobot.QUICK["pi0"]["sizes"]
    chunk, width = (
        bench_lerobot.QUICK_CONFIG["chunk_size"],
        bench_lerobot.QUICK_CONFIG["max_action_dim"],
    )
    for row in rows:
        assert row["stochastic_steps"] == 9  # sde_mode="all" at K = 10: steps 1..9
        for name, seconds in row["median_s"].items():
            assert seconds > 0, name
        for name, (low, median, high) in row["ratios"].items():
            assert math.isfinite(median) and 0 < low <= median <= high, name
        # The chain [K + 1, H, D] float32, mask [K] bool, step log-probs [K] and the sum.
        assert row["bytes_flow"] == 11 * chunk * width * 4 + 10 + 10 * 4 + 4
        tokens = row["prefix_tokens"]
        cache = 2 * sizes.depth * sizes.num_kv_heads * tokens * sizes.head_dim * 4 + tokens
        if row["model"] == "pi0":
            cache += bench_lerobot.QUICK_CONFIG["max_state_dim"] * 4  # pi0's padded state
        assert row["bytes_cache"] - row["bytes_flow"] == cache
        # The observations: one uint8 camera, the state (8 floats), tokens and mask.
        image = 3 * bench_lerobot.QUICK["pi0"]["image_size"] ** 2
        tokens_in = bench_lerobot.QUICK["pi0"]["tokens"]
        assert row["bytes_inputs"] - row["bytes_flow"] == image + 8 * 4 + tokens_in * 9
    assert saved["rows"] == json.loads(json.dumps(rows))  # the JSON holds the same rows
