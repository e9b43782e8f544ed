"""A robosuite scripted expert's success and episode lengths, with action noise.

The tables in ``torchrl_flowpolicy.tasks.robosuite.lift_expert``, ``torchrl_flowpolicy.tasks.robosuite.can_expert``
and ``torchrl_flowpolicy.tasks.robosuite.square_expert`` come from this script: the expert
(``LiftExpert``, ``CanExpert`` or ``SquareExpert``, built with ``from_env``)
runs ``--episodes`` episodes from reset seeds ``--first_seed`` on (never used for tuning),
Gaussian noise of standard deviation ``--action_noise`` added to all 7 action entries and
clipped, success ending an episode, up to ``--horizon`` steps (default: 400). Prints one JSON
line: the success rate, the successful episodes' length (mean, median, p90, max), the
success within shorter limits and within the task's own horizon (``task_horizon``).

Run (robosuite extra)::

    MUJOCO_GL=egl python benchmarks/expert_episodes.py --task PickPlaceCan \\
        --action_noise 0.3 --first_seed 1000 --episodes 100 --horizon 400
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from torchrl_flowpolicy.tasks.robosuite.env import TASKS, RobosuiteGymEnv
from torchrl_flowpolicy.tasks.robosuite.experts import EXPERTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(EXPERTS), default="Lift")
    parser.add_argument("--action_noise", type=float, default=0.0)
    parser.add_argument("--first_seed", type=int, default=1000)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--horizon", type=int, default=400)
    args = parser.parse_args()
    env = RobosuiteGymEnv(args.task, max_episode_steps=args.horizon)
    expert = EXPERTS[args.task].from_env(env, action_noise=args.action_noise, seed=0)
    lengths, successes, start = [], [], time.perf_counter()
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        observation, info = env.reset(seed=seed)
        steps, done = 0, False
        while not done:
            observation, _, terminated, truncated, info = env.step(expert.act(observation))
            steps, done = steps + 1, terminated or truncated
        lengths.append(steps)
        successes.append(bool(info["success"]))
    env.close()
    lengths, successes = np.array(lengths), np.array(successes)
    won = lengths[successes]
    task_horizon = TASKS[args.task].max_episode_steps
    limits = [limit for limit in (40, 50, 60, 100, 120, 150, 200, 250, 300) if limit < args.horizon]
    row = {
        "task": args.task,
        "action_noise": args.action_noise,
        "seeds": [args.first_seed, args.first_seed + args.episodes - 1],
        "horizon": args.horizon,
        "success": round(float(successes.mean()), 3),
        "task_horizon": task_horizon,
        "success_within_task_horizon": round(
            float((successes & (lengths <= task_horizon)).mean()), 3
        ),
        "within": {
            limit: round(float((successes & (lengths <= limit)).mean()), 3) for limit in limits
        },
        "seconds": round(time.perf_counter() - start, 1),
    }
    if len(won):
        row["length"] = {
            "mean": round(float(won.mean()), 1),
            "median": float(np.median(won)),
            "p90": float(np.percentile(won, 90)),
            "max": int(won.max()),
        }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
