"""Why PickPlaceCan episodes fail: :mod:`torchrl_flowpolicy.tasks.robosuite.can_outcomes` on made-up
observations (each kind, the order of the checks, bad input) and on robosuite's own episodes
(the scripted expert, an arm that holds still, an expert stopped while it carries the can)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from torchrl_flowpolicy.tasks.robosuite.can_outcomes import (
    CAN_OUTCOMES,
    can_rollout_outcomes,
    classify_can_episodes,
    distance_to_placement_edge,
)
from torchrl_flowpolicy.tasks.robosuite.layout import OBSERVATION_SLICES
from torchrl_flowpolicy.training.statistics import paired_bootstrap_interval

CAN = OBSERVATION_SLICES["PickPlaceCan"]
ROOT = Path(__file__).resolve().parents[1]
UPRIGHT = torch.tensor([0.0, 0.0, 0.0, 1.0])
# 90 degrees about x: the can's axis lies horizontal.
LYING = torch.tensor([math.sin(math.pi / 4), 0.0, 0.0, math.cos(math.pi / 4)])


def episode(heights: list[float], grip_offset: float, quaternion: torch.Tensor) -> torch.Tensor:
    """Observations [T + 1, 64]: the can at height z_t, the grip site grip_offset above
    the can's centre at every step, the can's orientation at the end."""
    observations = torch.zeros(len(heights), 64)
    observations[:, CAN["can_pos"]] = torch.tensor([0.1, -0.25, 0.0])
    observations[:, CAN["can_pos"].start + 2] = torch.tensor(heights)
    observations[:, CAN["eef_pos"]] = observations[:, CAN["can_pos"]]
    observations[:, CAN["eef_pos"].start + 2] += grip_offset
    observations[:, CAN["can_quat"]] = UPRIGHT
    observations[-1, CAN["can_quat"]] = quaternion
    return observations


def kinds(observations, last, success):
    indices = classify_can_episodes(observations, torch.tensor(last), torch.tensor(success))
    return [CAN_OUTCOMES[index] for index in indices.tolist()]


def test_each_kind_from_the_can_and_the_grip_site():
    start, lifted = 0.86, 0.86 + 0.031
    observations = torch.stack(
        [
            episode([start, lifted, start], 0.10, UPRIGHT),  # placed, let go: the task says
            episode([start, start + 0.029, start], 0.10, UPRIGHT),  # rose 2.9 cm only
            episode([start, lifted, lifted], 0.01, UPRIGHT),  # still in the hand
            episode([start, lifted, start], 0.10, LYING),  # let go, lying
            episode([start, lifted, start], 0.10, UPRIGHT),  # let go, standing, not placed
        ]
    )
    success = [True, False, False, False, False]
    assert kinds(observations, [1] * 5, success) == list(CAN_OUTCOMES)


def test_the_checks_come_in_order_and_read_only_the_episode():
    start = 0.86
    # Success wins over everything; a can never lifted is "never_lifted" even if it lies
    # under the hand (knocked over).
    held_lying = episode([start, start, start], 0.01, LYING)
    assert kinds(held_lying[None], [1], [True]) == ["success"]
    assert kinds(held_lying[None], [1], [False]) == ["never_lifted"]
    # A lift after the episode's end (the next episode's) does not count, and the final
    # observation is the one after decision `last`, not the rollout's last.
    later_lift = episode([start, start, start + 0.2, start + 0.2], 0.10, UPRIGHT)
    later_lift[1, CAN["can_quat"]] = LYING  # the end of the episode ending at decision 0
    assert kinds(later_lift[None], [0], [False]) == ["never_lifted"]
    assert kinds(later_lift[None], [2], [False]) == ["released_upright"]
    lifted_early = episode([start, start + 0.2, start, start], 0.10, UPRIGHT)
    lifted_early[1, CAN["can_quat"]] = LYING
    assert kinds(lifted_early[None], [0], [False]) == ["fell_over"]


def test_bad_input_is_refused():
    observations = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match=r"\[N, T \+ 1, 64\]"):
        classify_can_episodes(torch.zeros(2, 3, 60), torch.tensor([0, 0]), torch.ones(2))
    with pytest.raises(ValueError, match="last and success must be"):
        classify_can_episodes(observations, torch.tensor([0]), torch.ones(2))
    with pytest.raises(ValueError, match=r"last must lie in \[0, 1\]"):
        classify_can_episodes(observations, torch.tensor([0, 2]), torch.ones(2))


# ----------------------------------------------------------------------------- robosuite
def can_episodes(policy_for, steps: int) -> list[str]:
    """Two PickPlaceCan episodes (validation reset seeds 20000-20001, one action per step,
    ``steps`` steps at most), sorted by kind."""
    pytest.importorskip("robosuite")
    from torchrl_flowpolicy.tasks.registry import get_task
    from torchrl_flowpolicy.training.evaluation import evaluate_episodes

    task = get_task("can")
    assert task.episode_kinds.names == CAN_OUTCOMES  # what evaluate.py --failure_kinds reads
    env = task.make_env(2, None, max_episode_steps=steps)
    try:
        outcomes = evaluate_episodes(
            policy_for(env),
            env,
            max_decisions=steps,
            seed=20_000,
            details=task.episode_kinds.classify,
        )
    finally:
        env.close()
    assert outcomes["kind"].shape == outcomes["success"].shape == (2,)
    return [CAN_OUTCOMES[index] for index in outcomes["kind"].tolist()]


@pytest.mark.slow
def test_robosuite_episodes_of_each_kind():
    from torchrl_flowpolicy.tasks.registry import get_task

    def expert(env):
        return get_task("can").make_expert(env)

    def still(env):
        action_shape = env.full_action_spec_unbatched["action"].shape
        return TensorDictModule(
            lambda observation: torch.zeros(*observation.shape[:-1], *action_shape),
            in_keys=["observation"],
            out_keys=["action"],
        )

    assert can_episodes(expert, 250) == ["success", "success"]
    assert can_episodes(still, 12) == ["never_lifted", "never_lifted"]
    # Stopped at 60 steps, the expert carries the can (it places it in 96 steps on average).
    assert can_episodes(expert, 60) == ["not_released", "not_released"]


def test_rollout_outcomes_read_the_episode_not_the_next_reset():
    # A rollout [1, 3] whose episode ends at decision 1: its observation at decision 2 is
    # the next episode's reset (the can back on the floor), its ("next", "observation") at
    # decision 1 the episode's end (the can lifted 0.2 m and held).
    start = 0.86
    frames = episode([start, start, start + 0.2, start], 0.01, UPRIGHT)  # obs after each
    rollout = TensorDict(
        {
            "observation": torch.stack([frames[0], frames[1], frames[3]])[None],
            "next": {"observation": frames[1:][None]},
        },
        batch_size=[1, 3],
    )
    outcomes = {"length": torch.tensor([2]), "success": torch.tensor([False])}
    kind = can_rollout_outcomes(rollout, outcomes)["kind"]
    assert CAN_OUTCOMES[kind.item()] == "not_released"


def test_evaluate_rows_count_the_kinds():
    from examples_loader import load_example

    evaluate = load_example("evaluate")
    outcomes = {
        "return": torch.zeros(3),
        "success": torch.tensor([True, False, False]),
        "length": torch.tensor([40, 63, 63]),
        "kind": torch.tensor([0, 2, 2]),
    }
    row = evaluate.report_row(outcomes, "policy", CAN_OUTCOMES, checkpoint="policy.pt")
    assert row["episode_kinds"] == {
        "success": 1,
        "never_lifted": 0,
        "not_released": 2,
        "fell_over": 0,
        "released_upright": 0,
    }
    assert row["episode_kind"] == ["success", "not_released", "not_released"]
    assert row["episode_length"] == [40, 63, 63]
    without = {key: value for key, value in outcomes.items() if key != "kind"}
    assert "episode_kinds" not in evaluate.report_row(without, "policy")


def test_distance_to_the_placement_edge_is_the_nearest_side():
    # x in [-0.02, 0.22], y in [-0.42, -0.08]: the centre is 0.12 / 0.17 from the sides.
    xy = torch.tensor([[0.10, -0.25], [0.21, -0.25], [0.10, -0.41], [-0.03, -0.25]])
    expected = torch.tensor([0.12, 0.01, 0.01, -0.01])
    torch.testing.assert_close(distance_to_placement_edge(xy), expected)
    # Any batch shape.
    assert distance_to_placement_edge(torch.zeros(2, 3, 2)).shape == (2, 3)


def test_the_failure_report_bands_pairs_and_counts(monkeypatch):
    pytest.importorskip("robosuite")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    can_failures = importlib.import_module("can_failures")
    kinds_before = ["never_lifted", "success", "never_lifted", "fell_over"]
    kinds_after = ["never_lifted", "success", "success", "released_upright"]
    rows = [
        {"episode_kind": kind, "episode_length": [10, 20, 30, 40]}
        for kind in (kinds_before, kinds_after)
    ]
    evaluation = {"seed": 20_000, "rows": rows}
    # Demonstrations starting 1 cm, 3 cm and 12 cm inside the edge (and a later step).
    observations = torch.zeros(4, 64)
    observations[:, CAN["can_pos"]] = torch.tensor(
        [[0.21, -0.25, 0.86], [0.10, -0.11, 0.86], [0.10, -0.25, 0.86], [0.21, -0.09, 0.9]]
    )
    demonstrations = {"observation": observations, "step": torch.tensor([0, 0, 0, 1])}
    lines = can_failures.report(evaluation, demonstrations, executed_chunk_length=4)
    distances = can_failures.reset_distances(20_000, 4)
    band_rows = [line.split(" | ") for line in lines[1:4]]
    assert sum(int(row[1]) for row in band_rows) == 4
    for (low, high), row in zip(can_failures.BANDS, band_rows, strict=True):
        states = [i for i, distance in enumerate(distances) if low <= distance < high]
        assert int(row[1]) == len(states)
        assert int(row[2]) == sum(kinds_before[i] != "success" for i in states)
        assert int(row[3]) == sum(kinds_after[i] != "success" for i in states)
    assert lines[4].endswith("2 of 2")  # both PPO failures were BC failures
    assert lines[5].endswith(": 1")  # never lifted under both: the first state
    assert lines[6].endswith("median 80, 90th percentile 80, max 80")  # success: 20 decisions
    assert "median 120, 90th percentile 120, max 120" in lines[7]  # 80 and 120 env steps
    difference, low, high = paired_bootstrap_interval(
        torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0])
    )
    assert difference == 0.25  # the third state, failed before, succeeds after
    expected = f"+25.0 points [{100 * low:+.1f}, {100 * high:+.1f}] (paired bootstrap over the 4"
    assert lines[8] == f"second row - first row: {expected} states)"
    assert lines[9] == "demonstrations' starts: 0-2 cm 1, 2-4 cm 1, 4 cm or more 1 (of 3)"
    # Two JSONs of one row each on the same states read as one of two rows.
    one_each = [{"seed": 20_000, "rows": [row]} for row in rows]
    assert can_failures.merge_evaluations(one_each) == evaluation
    with pytest.raises(ValueError, match="different states"):
        can_failures.merge_evaluations([one_each[0], {"seed": 30_000, "rows": rows[1:]}])
    with pytest.raises(ValueError, match="different states"):
        shorter = {"episode_kind": kinds_after[:3], "episode_length": [10, 20, 30]}
        can_failures.merge_evaluations([one_each[0], {"seed": 20_000, "rows": [shorter]}])
    with pytest.raises(ValueError, match="two rows"):
        can_failures.report({"seed": 20_000, "rows": rows[:1]})
    with pytest.raises(ValueError, match="--failure_kinds"):
        can_failures.report({"seed": 20_000, "rows": [{"success_rate": 0.5}] * 2})


def test_an_evaluation_is_read_whole_or_as_one_row(monkeypatch, tmp_path):
    pytest.importorskip("robosuite")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    can_failures = importlib.import_module("can_failures")
    rows = [{"success_rate": 0.25}, {"success_rate": 0.75}]
    path = tmp_path / "run:2" / "evaluation.json"  # a colon that is not a row index
    path.parent.mkdir()
    path.write_text(json.dumps({"seed": 20_000, "rows": rows}))
    assert can_failures.read_evaluation(str(path)) == {"seed": 20_000, "rows": rows}
    assert can_failures.read_evaluation(f"{path}:1") == {"seed": 20_000, "rows": rows[1:]}
    assert can_failures.read_evaluation(f"{path}:0")["rows"] == rows[:1]
    with pytest.raises(IndexError):
        can_failures.read_evaluation(f"{path}:2")


def test_the_split_states_count_each_splits_first_resets_by_band(monkeypatch):
    pytest.importorskip("robosuite")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    can_failures = importlib.import_module("can_failures")
    (line,) = can_failures.split_state_lines("validation:5")
    counts = can_failures.band_counts(can_failures.reset_distances(20_000, 5))
    assert sum(counts) == 5
    bands = ", ".join(
        f"{can_failures.band_name(*band)} {n}"
        for band, n in zip(can_failures.BANDS, counts, strict=True)
    )
    assert line == f"validation states (reset seeds from 20000): {bands} (of 5)"
    assert can_failures.band_counts([0.0, 0.019, 0.02, 0.05]) == [2, 1, 1]
    with pytest.raises(ValueError, match="split:episodes"):
        can_failures.split_state_lines("validation")
    with pytest.raises(ValueError, match="unknown split"):
        can_failures.split_state_lines("training:5")
