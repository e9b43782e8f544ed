"""The default task's demonstrations: the noisy scripted Pusher expert, rolled out.

:func:`collect_demos` rolls out :class:`~torchrl_flowpolicy.tasks.pusher.expert.PusherExpert`
with Gaussian action noise on gymnasium ``Pusher-v5``. :func:`collect_task_demos` (the same
with the task's options) and :func:`rescore_success` are the ``"pusher"`` task's
:attr:`~torchrl_flowpolicy.tasks.registry.Task.collect_demos` and
:attr:`~torchrl_flowpolicy.tasks.registry.DemoSettings.rescore`;
:func:`~torchrl_flowpolicy.tasks.demonstrations.load_or_collect_demos` caches what any task's
collector returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from torchrl_flowpolicy.tasks.pusher.env import (
    DEFAULT_MAX_EPISODE_STEPS,
    DEFAULT_SUCCESS_THRESHOLD,
    PUSHER_ENV_ID,
    object_goal_distance,
)
from torchrl_flowpolicy.tasks.pusher.expert import PusherExpert

__all__ = ["collect_demos", "collect_task_demos", "rescore_success"]


def collect_demos(
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    *,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Roll out the noisy :class:`PusherExpert` for ``num_episodes`` episodes.

    Episode ``i`` resets the environment with seed ``seed * 1_000_003 + i`` (so the first
    ``n`` episodes do not depend on ``num_episodes``); the expert's noise generator is seeded
    with ``seed``.

    Args:
        num_episodes: number of episodes, each ``max_episode_steps`` steps long.
        action_noise: standard deviation of the Gaussian noise added to the expert's torques.
        seed: seed of the environment resets and of the noise.
        max_episode_steps: the episode length.
        success_threshold: the threshold of the stored per-episode success flags.

    Keyword Args:
        progress: called with 1 after every episode (e.g. a tqdm ``update``).

    Returns:
        A dict of tensors with ``T = num_episodes * max_episode_steps`` rows, in episode
        order: ``"observation"`` ``[T, 23]`` float32 (before the action), ``"action"``
        ``[T, 7]`` float32 (the executed, noisy and clipped torques), ``"expert_action"``
        ``[T, 7]`` (the clean torques), ``"reward"`` ``[T]`` (gymnasium's own reward), ``"episode"``
        ``[T]`` int64, ``"step"`` ``[T]`` int64; per episode ``"episode_seed"`` ``[N]``,
        ``"final_distance"`` ``[N]`` float32, ``"success"`` ``[N]`` bool; and ``"config"``, a
        dict of the arguments plus ``"wall_time_s"``.
    """
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}.")
    env = gym.make(PUSHER_ENV_ID, max_episode_steps=max_episode_steps)
    expert = PusherExpert(env, action_noise=action_noise, seed=seed)
    steps = num_episodes * max_episode_steps
    observations = np.zeros((steps, 23), dtype=np.float32)
    actions = np.zeros((steps, 7), dtype=np.float32)
    expert_actions = np.zeros((steps, 7), dtype=np.float32)
    rewards = np.zeros(steps, dtype=np.float32)
    episode_seeds = np.zeros(num_episodes, dtype=np.int64)
    final_distances = np.zeros(num_episodes, dtype=np.float32)
    start = time.perf_counter()
    row = 0
    for episode in range(num_episodes):
        episode_seed = seed * 1_000_003 + episode
        episode_seeds[episode] = episode_seed
        observation, _ = env.reset(seed=episode_seed)
        expert.reset()
        for _ in range(max_episode_steps):
            action = expert.act()
            observations[row] = observation
            actions[row] = action
            expert_actions[row] = expert.last_clean_action
            observation, reward, terminated, truncated, _ = env.step(action)
            rewards[row] = reward
            row += 1
            if terminated:
                raise RuntimeError(
                    "Pusher-v5 terminated early; demos assume fixed-length episodes."
                )
        final_distances[episode] = object_goal_distance(observation)
        if progress is not None:
            progress(1)
    env.close()
    final_distance = torch.from_numpy(final_distances)
    return {
        "observation": torch.from_numpy(observations),
        "action": torch.from_numpy(actions),
        "expert_action": torch.from_numpy(expert_actions),
        "reward": torch.from_numpy(rewards),
        "episode": torch.arange(num_episodes).repeat_interleave(max_episode_steps),
        "step": torch.arange(max_episode_steps).repeat(num_episodes),
        "episode_seed": torch.from_numpy(episode_seeds),
        "final_distance": final_distance,
        "success": final_distance < success_threshold,
        "config": {
            "num_episodes": int(num_episodes),
            "action_noise": float(action_noise),
            "seed": int(seed),
            "max_episode_steps": int(max_episode_steps),
            "success_threshold": float(success_threshold),
            "wall_time_s": float(time.perf_counter() - start),
        },
    }


def collect_task_demos(
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    *,
    progress: Callable[[int], None] | None = None,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    reward: str = "progress",
) -> dict[str, Any]:
    """:func:`collect_demos` called with the ``"pusher"`` task's options (those of
    :func:`~torchrl_flowpolicy.tasks.make_pusher_env`). ``reward`` does not change the set:
    it stores gymnasium's reward, and the environment computes the task's reward itself."""
    del reward
    return collect_demos(
        num_episodes,
        action_noise,
        seed,
        max_episode_steps,
        success_threshold,
        progress=progress,
    )


def rescore_success(demos: dict[str, Any], options: Mapping[str, Any]) -> None:
    """Set a stored set's per-episode ``"success"`` for the requested ``success_threshold``
    (default 0.05 m): an episode succeeds when its final object-goal distance is below it."""
    threshold = options.get("success_threshold", DEFAULT_SUCCESS_THRESHOLD)
    demos["success"] = demos["final_distance"] < threshold
    demos["config"]["success_threshold"] = float(threshold)
