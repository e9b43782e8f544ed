"""Demonstrations for the default task: the noisy scripted expert, rolled out and cached.

:func:`collect_demos` rolls out :class:`~torchrl_flowpolicy.envs.pusher_expert.PusherExpert`
with Gaussian action noise on gymnasium ``Pusher-v5``; :func:`load_or_collect_demos` caches
the result in one file (written with :func:`~torchrl_flowpolicy.checkpoint.atomic_write`,
read with ``torch.load(weights_only=True)``) and reuses it.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from torchrl_flowpolicy.checkpoint import atomic_write
from torchrl_flowpolicy.envs.pusher import (
    DEFAULT_MAX_EPISODE_STEPS,
    DEFAULT_SUCCESS_THRESHOLD,
    PUSHER_ENV_ID,
    object_goal_distance,
)
from torchrl_flowpolicy.envs.pusher_expert import PusherExpert

__all__ = ["collect_demos", "demos_path", "load_or_collect_demos"]


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


def demos_path(
    directory: str | os.PathLike,
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    *,
    task: str = "pusher",
) -> Path:
    """Where :func:`load_or_collect_demos` caches a demonstration set.

    ``{directory}/{task}_T{max_episode_steps}_action_noise{action_noise}_n{num_episodes}_seed{seed}.pt``

    Examples:
        >>> demos_path("outputs/demos", 200, 0.7).name
        'pusher_T150_action_noise0.7_n200_seed0.pt'
    """
    return Path(directory) / (
        f"{task}_T{max_episode_steps}_action_noise{action_noise:g}_n{num_episodes}_seed{seed}.pt"
    )


def load_or_collect_demos(
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
    *,
    task: str = "pusher",
    directory: str | os.PathLike = "outputs/demos",
    progress: Callable[[int], None] | None = None,
    **task_options: Any,
) -> tuple[dict[str, Any], Path, bool]:
    """Load a cached demonstration set, or collect it and cache it atomically.

    The file (see :func:`demos_path`) is written with
    :func:`~torchrl_flowpolicy.checkpoint.atomic_write` (a killed run leaves no partial file)
    and read with ``torch.load(weights_only=True)``.
    A cached file whose stored configuration does not match is an error (delete it or pick
    another folder). The per-episode ``"success"`` flags are recomputed for
    ``success_threshold`` from the stored final distances.

    Args:
        num_episodes: as for :func:`collect_demos`.
        action_noise: as for :func:`collect_demos`.
        seed: as for :func:`collect_demos`.
        max_episode_steps: as for :func:`collect_demos`.
        success_threshold: as for :func:`collect_demos` (``"pusher"`` only).

    Keyword Args:
        task: the :class:`~torchrl_flowpolicy.envs.tasks.Task` whose expert makes the set
            (default ``"pusher"``: :func:`collect_demos`); other tasks store their own
            per-episode ``"success"`` flags.
        directory: the cache folder.
        progress: forwarded to the collector when collecting.
        **task_options: further options of the task's ``collect_demos`` (for ``"lift"``:
            ``reward``, ``terminate_on_success``); part of the stored configuration.

    Returns:
        ``(demos, path, loaded)``: the dict described in :func:`collect_demos`, its file, and
        whether it came from the cache.
    """
    path = demos_path(directory, num_episodes, action_noise, seed, max_episode_steps, task=task)
    if path.exists():
        demos = torch.load(path, weights_only=True)
        stored = demos["config"]
        expected = {
            "num_episodes": num_episodes,
            "action_noise": float(action_noise),
            "seed": seed,
            "max_episode_steps": max_episode_steps,
            **task_options,
        }
        mismatched = {k: (stored.get(k), v) for k, v in expected.items() if stored.get(k) != v}
        if mismatched:
            raise ValueError(
                f"cached demos at {path} were collected with other settings "
                f"(stored, requested): {mismatched}; delete the file or use another directory."
            )
        if task == "pusher":
            demos["success"] = demos["final_distance"] < success_threshold
            demos["config"]["success_threshold"] = float(success_threshold)
        return demos, path, True
    if task == "pusher":
        demos = collect_demos(
            num_episodes,
            action_noise,
            seed,
            max_episode_steps,
            success_threshold,
            progress=progress,
        )
    else:
        from torchrl_flowpolicy.envs.tasks import get_task

        demos = get_task(task).collect_demos(
            num_episodes,
            action_noise,
            seed,
            progress=progress,
            max_episode_steps=max_episode_steps,
            **task_options,
        )
        demos["config"].update(task=task, **task_options)
    atomic_write(path, functools.partial(torch.save, demos))
    return demos, path, False
