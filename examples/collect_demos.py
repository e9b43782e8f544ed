"""Collect demonstrations for the default task: the noisy scripted expert on Pusher-v5.

The scripted ``PusherExpert`` (inverse-kinematics control of the wrist: cage the object in
the wrist's U, then push it to the goal) runs for ``num_episodes`` episodes of
``max_episode_steps`` steps with Gaussian noise of standard deviation ``action_noise``
added to its torques. The default noise, 0.7, leaves the demonstrations at about 55 % success
(the clean expert: about 90 %), so a policy that copies them, noise included, stays well
below the expert. The observations, the executed (noisy) actions, the
clean expert actions and the per-episode outcome are cached in one file,
``{output_dir}/pusher_T{steps}_action_noise{noise}_n{episodes}_seed{seed}.pt``, written atomically
and readable with ``torch.load(path, weights_only=True)``; a second run with the same
settings loads it instead of collecting again. The script prints the demonstrations' success
rate (final horizontal object-goal distance below ``success_threshold``) and its wall time.

Other scripts get the same data with
``torchrl_flowpolicy.tasks.load_or_collect_demos(num_episodes, action_noise, seed)``.

Run (every option: ``--help``)::

    python examples/collect_demos.py
    python examples/collect_demos.py --num_episodes 50 --action_noise 0.5
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from torchrl_flowpolicy.tasks import load_or_collect_demos
from torchrl_flowpolicy.tasks.pusher.env import DEFAULT_MAX_EPISODE_STEPS, DEFAULT_SUCCESS_THRESHOLD

from common import option, parse_config


@dataclass
class CollectConfig:
    """Demonstration settings; every field is a command-line option."""

    num_episodes: int = option(200, "episodes to roll out with the noisy expert")
    action_noise: float = option(0.7, "std of the Gaussian noise added to the expert's torques")
    max_episode_steps: int = option(DEFAULT_MAX_EPISODE_STEPS, "steps per episode (time limit)")
    success_threshold: float = option(
        DEFAULT_SUCCESS_THRESHOLD, "final horizontal object-goal distance that counts as success, m"
    )
    seed: int = option(0, "seed of the episode resets and of the expert's noise")
    output_dir: str = option("outputs/demos", "cache folder of the demonstration files")
    threads: int = option(1, "torch CPU threads")


def main(cfg: CollectConfig) -> dict:
    print("config:", json.dumps(dataclasses.asdict(cfg)))
    torch.set_num_threads(cfg.threads)
    start = time.perf_counter()

    # ------------------------------------------------------------------------- collect or load
    with tqdm(total=cfg.num_episodes, unit="episode", dynamic_ncols=True) as progress:
        demos, path, loaded = load_or_collect_demos(
            cfg.num_episodes,
            cfg.action_noise,
            cfg.seed,
            max_episode_steps=cfg.max_episode_steps,
            success_threshold=cfg.success_threshold,
            directory=cfg.output_dir,
            progress=progress.update,
        )
    wall_time = time.perf_counter() - start

    # ------------------------------------------------------------------------- report
    final_distance = demos["final_distance"]
    summary = {
        "path": str(path),
        "loaded_from_cache": loaded,
        "episodes": int(final_distance.numel()),
        "steps": int(demos["observation"].shape[0]),
        "success_rate": float(demos["success"].float().mean()),
        "final_distance_median": float(final_distance.median()),
        "collection_wall_time_s": demos["config"]["wall_time_s"],
        "wall_time_s": wall_time,
    }
    source = "loaded from" if loaded else "collected and saved to"
    print(f"demonstrations {source} {path}")
    print(
        f"{summary['episodes']} episodes, {summary['steps']} steps; success rate "
        f"{summary['success_rate']:.1%} (final distance < {cfg.success_threshold} m, median "
        f"{summary['final_distance_median']:.3f} m); collection took "
        f"{summary['collection_wall_time_s']:.1f} s, this run {wall_time:.1f} s"
    )
    return summary


if __name__ == "__main__":
    main(parse_config(CollectConfig, description=__doc__))
