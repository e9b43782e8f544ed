"""Where a PickPlaceCan policy fails: its episodes' kinds against the can's start.

Reads the JSON of ``examples/evaluate.py --failure_kinds`` with two rows (a behaviour-cloned
checkpoint, then its fine-tuned one, on the same states), or two such JSONs of one row each
(comma-separated, the same split and episodes; ``path:i`` takes row ``i`` of a JSON), and
prints:

1. per band of the can's distance to the edge of its placement range at the reset
   (:func:`~torchrl_flowpolicy.tasks.robosuite.can_outcomes.distance_to_placement_edge`), the states and
   each row's failures;
2. the pairing: the second row's failures that were failures of the first, and the states
   "never lifted" under both;
3. each row's successful episodes' lengths in env steps (median, 90th percentile, maximum);
4. the paired difference of the success rates, second row minus first, with the protocol's
   bootstrap interval over the states (:func:`~torchrl_flowpolicy.training.statistics.paired_bootstrap_interval`);
5. with ``--demonstrations``, how many demonstrations start in each band;
6. with ``--split_states`` (``split:episodes`` items), how many of each protocol split's first
   states (:mod:`torchrl_flowpolicy.training.protocol`) start in each band, e.g. whether the learning
   curve's 50 episodes hold as many cans near the edge as the 200 validation ones.

The reset states are rebuilt from the JSON's first reset seed (episode ``i`` resets with
``seed + i``), so nothing but the JSON and the demonstrations file is needed.

Run (robosuite extra), after the evaluation in docs/robosuite.md::

    MUJOCO_GL=egl python benchmarks/can_failures.py \\
        --evaluation_json outputs/kinds_can_s0_val.json \\
        --demonstrations outputs/demos/can_T250_action_noise0.3_n20_seed0.pt
    MUJOCO_GL=egl python benchmarks/can_failures.py --split_states curve:50,validation:200
    MUJOCO_GL=egl python benchmarks/can_failures.py \\
        --evaluation_json outputs/kinds_can_s1_long_val_k4.json:0,outputs/kinds_can_s1_decay_val_k4.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from torchrl_flowpolicy.tasks.robosuite.can_outcomes import distance_to_placement_edge
from torchrl_flowpolicy.tasks.robosuite.env import RobosuiteGymEnv
from torchrl_flowpolicy.tasks.robosuite.layout import OBSERVATION_SLICES
from torchrl_flowpolicy.training.protocol import split_seed
from torchrl_flowpolicy.training.statistics import paired_bootstrap_interval

BANDS = ((0.0, 0.02), (0.02, 0.04), (0.04, float("inf")))
_CAN = OBSERVATION_SLICES["PickPlaceCan"]["can_pos"]
CAN_XY = slice(_CAN.start, _CAN.start + 2)  # the can's centre, x and y


def band_name(low: float, high: float) -> str:
    if high == float("inf"):
        return f"{100 * low:.0f} cm or more"
    return f"{100 * low:.0f}-{100 * high:.0f} cm"


def reset_distances(first_seed: int, num_episodes: int) -> list[float]:
    """The can's distance to the edge of its range at each episode's reset (m)."""
    env = RobosuiteGymEnv("PickPlaceCan")
    try:
        positions = [env.reset(seed=first_seed + i)[0][CAN_XY] for i in range(num_episodes)]
    finally:
        env.close()
    return distance_to_placement_edge(torch.as_tensor(np.stack(positions))).tolist()


def band_counts(distances: list[float]) -> list[int]:
    """How many of ``distances`` (m) fall in each of :data:`BANDS`."""
    return [sum(low <= distance < high for distance in distances) for low, high in BANDS]


def split_state_lines(items: str) -> list[str]:
    """One line per ``split:episodes`` item of ``items`` (comma-separated): how many of the
    split's first ``episodes`` reset states start in each band."""
    lines = []
    for item in items.split(","):
        split, _, episodes = item.partition(":")
        if not episodes.isdigit():
            raise ValueError(f"expected split:episodes (e.g. validation:200), got {item!r}.")
        first_seed = split_seed(split, int(episodes))  # checks the split and the count
        counts = band_counts(reset_distances(first_seed, int(episodes)))
        bands = ", ".join(f"{band_name(*band)} {n}" for band, n in zip(BANDS, counts, strict=True))
        lines.append(f"{split} states (reset seeds from {first_seed}): {bands} (of {episodes})")
    return lines


def read_evaluation(item: str) -> dict:
    """The evaluation JSON at ``item`` (``path``), or only its row ``i`` (``path:i``)."""
    path, separator, index = item.rpartition(":")
    if not (separator and index.isdigit()):
        path, index = item, ""
    evaluation = json.loads(Path(path).read_text())
    if index:
        evaluation["rows"] = [evaluation["rows"][int(index)]]
    return evaluation


def merge_evaluations(evaluations: list[dict]) -> dict:
    """One evaluation holding the rows of ``evaluations`` in order, which must share their
    split's first reset seed and their number of episodes (the same states)."""
    first = evaluations[0]
    for evaluation in evaluations[1:]:
        counts = {len(row.get("episode_kind", [])) for row in first["rows"] + evaluation["rows"]}
        if evaluation["seed"] != first["seed"] or len(counts) != 1:
            raise ValueError(
                f"the evaluations hold different states (first reset seeds {first['seed']} and "
                f"{evaluation['seed']}, episode counts {sorted(counts)}): evaluate them on one "
                "split with the same --eval_episodes."
            )
    return {"seed": first["seed"], "rows": [row for item in evaluations for row in item["rows"]]}


def report(
    evaluation: dict, demonstrations: dict | None = None, executed_chunk_length: int = 4
) -> list[str]:
    """The report's lines (above) for an evaluation's JSON and, optionally, demonstrations;
    an episode's length in the JSON counts decisions of ``executed_chunk_length`` env steps."""
    if len(evaluation["rows"]) != 2:
        raise ValueError(
            f"expected two rows (before and after RL on the same states), got "
            f"{len(evaluation['rows'])}; evaluate two checkpoints at one noise scale."
        )
    before, after = evaluation["rows"]
    if "episode_kind" not in before:
        raise ValueError("the rows have no episode kinds: evaluate with --failure_kinds.")
    distances = reset_distances(evaluation["seed"], len(before["episode_kind"]))
    lines = ["can's distance to the edge at reset | states | first row fails | second row fails"]
    for low, high in BANDS:
        states = [i for i, distance in enumerate(distances) if low <= distance < high]
        fails = [
            sum(row["episode_kind"][i] != "success" for i in states) for row in (before, after)
        ]
        lines.append(f"{band_name(low, high)} | {len(states)} | {fails[0]} | {fails[1]}")
    pairs = list(zip(before["episode_kind"], after["episode_kind"], strict=True))
    both = sum(first != "success" and second != "success" for first, second in pairs)
    never = sum(first == second == "never_lifted" for first, second in pairs)
    failures = sum(second != "success" for _, second in pairs)
    lines.append(f"second row's failures that the first row failed too: {both} of {failures}")
    lines.append(f"never lifted under both: {never}")
    for name, row in (("first row", before), ("second row", after)):
        steps = sorted(
            executed_chunk_length * length
            for length, kind in zip(row["episode_length"], row["episode_kind"], strict=True)
            if kind == "success"
        )
        if steps:
            lines.append(
                f"{name} successes, env steps: median {steps[len(steps) // 2]}, "
                f"90th percentile {steps[int(0.9 * len(steps))]}, max {steps[-1]}"
            )
    successes = [
        torch.tensor([kind == "success" for kind in row["episode_kind"]]).float()
        for row in (after, before)
    ]
    difference, low, high = (100 * value for value in paired_bootstrap_interval(*successes))
    lines.append(
        f"second row - first row: {difference:+.1f} points [{low:+.1f}, {high:+.1f}] "
        f"(paired bootstrap over the {len(pairs)} states)"
    )
    if demonstrations is not None:
        starts = demonstrations["observation"][demonstrations["step"] == 0][:, CAN_XY]
        first = distance_to_placement_edge(starts).tolist()
        counts = band_counts(first)
        bands = ", ".join(f"{band_name(*band)} {n}" for band, n in zip(BANDS, counts, strict=True))
        lines.append(f"demonstrations' starts: {bands} (of {len(first)})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--evaluation_json",
        default=None,
        help="one JSON of two rows, or two of one (path:i: row i), comma-separated",
    )
    parser.add_argument(
        "--split_states", default="", help="split:episodes items, e.g. curve:50,validation:200"
    )
    parser.add_argument("--demonstrations", type=Path, default=None)
    parser.add_argument(
        "--executed_chunk_length", type=int, default=4, help="env steps per decision (H')"
    )
    args = parser.parse_args()
    if args.evaluation_json is None and not args.split_states:
        parser.error("give --evaluation_json, --split_states or both.")
    if args.evaluation_json is None and args.demonstrations is not None:
        parser.error("--demonstrations is reported with an --evaluation_json.")
    lines = split_state_lines(args.split_states) if args.split_states else []
    if args.evaluation_json is not None:
        items = args.evaluation_json.split(",")
        evaluation = merge_evaluations([read_evaluation(item) for item in items])
        demonstrations = (
            torch.load(args.demonstrations, weights_only=False) if args.demonstrations else None
        )
        lines += report(evaluation, demonstrations, args.executed_chunk_length)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
