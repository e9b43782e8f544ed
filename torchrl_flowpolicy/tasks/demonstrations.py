"""Demonstrations of any task, cached: collected once by the task's noisy scripted expert.

:func:`load_or_collect_demos` returns a task's demonstration set
(:attr:`~torchrl_flowpolicy.tasks.registry.Task.collect_demos`: for the default task
:func:`~torchrl_flowpolicy.tasks.pusher.demos.collect_demos`), from the cache file
:func:`demos_path` names when it is there, else collected and written there with
:func:`~torchrl_flowpolicy.training.checkpoint.atomic_write`; it is read with
``torch.load(weights_only=True)``. What a set depends on and how its success flags follow
the requested options are the task's :class:`~torchrl_flowpolicy.tasks.registry.DemoSettings`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchrl_flowpolicy.tasks.registry import get_task
from torchrl_flowpolicy.training.checkpoint import atomic_write

__all__ = ["demos_path", "load_or_collect_demos"]


def demos_path(
    directory: str | os.PathLike,
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    max_episode_steps: int | None = None,
    *,
    task: str = "pusher",
) -> Path:
    """Where :func:`load_or_collect_demos` caches a demonstration set.

    ``{directory}/{task}_T{max_episode_steps}_action_noise{action_noise}_n{num_episodes}_seed{seed}.pt``
    (``max_episode_steps=None``: the task's horizon,
    :attr:`~torchrl_flowpolicy.tasks.registry.Task.max_episode_steps`).

    Examples:
        >>> demos_path("outputs/demos", 200, 0.7).name
        'pusher_T150_action_noise0.7_n200_seed0.pt'
        >>> demos_path("outputs/demos", 25, 0.3, task="lift").name
        'lift_T60_action_noise0.3_n25_seed0.pt'
    """
    if max_episode_steps is None:
        max_episode_steps = get_task(task).max_episode_steps
    return Path(directory) / (
        f"{task}_T{max_episode_steps}_action_noise{action_noise:g}_n{num_episodes}_seed{seed}.pt"
    )


def load_or_collect_demos(
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    *,
    task: str = "pusher",
    directory: str | os.PathLike = "outputs/demos",
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> tuple[dict[str, Any], Path, bool]:
    """Load a cached demonstration set of ``task``, or collect it and cache it atomically.

    The file (see :func:`demos_path`) is written with
    :func:`~torchrl_flowpolicy.training.checkpoint.atomic_write` (a killed run leaves no
    partial file) and read with ``torch.load(weights_only=True)``. A set depends on the task's
    :attr:`~torchrl_flowpolicy.tasks.registry.DemoSettings.cached_options` (stored in its
    ``"config"``): a cached file made with other values is an error (delete it or pick another
    folder). A loaded set's per-episode ``"success"`` flags follow the requested options
    where the task says how (:attr:`~torchrl_flowpolicy.tasks.registry.DemoSettings.rescore`:
    Pusher's ``success_threshold``, from the stored final distances).

    Args:
        num_episodes: the number of episodes.
        action_noise: the std of the Gaussian noise added to the expert's actions.
        seed: seed of the episode resets (episode ``i``: ``seed * 1_000_003 + i``) and of
            the noise.

    Keyword Args:
        task: the :class:`~torchrl_flowpolicy.tasks.registry.Task` whose expert makes the set.
        directory: the cache folder.
        progress: forwarded to the collector when collecting.
        **options: the task's options (:attr:`~torchrl_flowpolicy.tasks.registry.Task.option_names`,
            e.g. ``max_episode_steps``, Pusher's ``success_threshold``, Lift's
            ``terminate_on_success``); the others take the task's defaults.

    Returns:
        ``(demos, path, loaded)``: the dict described in
        :func:`~torchrl_flowpolicy.tasks.collect_demos`, its file, and whether it came from
        the cache.

    Raises:
        ValueError: an option the task does not take, or a cached file made with other
            settings.
    """
    spec = get_task(task)
    unknown = sorted(set(options) - set(spec.option_names))
    if unknown:
        raise ValueError(
            f"task {task!r} takes the options {list(spec.option_names)}, not {unknown}."
        )
    options = {**spec.defaults, **options}
    cached = {name: options[name] for name in spec.demos.cached_options}
    path = demos_path(
        directory, num_episodes, action_noise, seed, options["max_episode_steps"], task=task
    )
    if path.exists():
        demos = torch.load(path, weights_only=True)
        stored = demos["config"]
        expected = {
            "num_episodes": num_episodes,
            "action_noise": float(action_noise),
            "seed": seed,
            **cached,
        }
        mismatched = {k: (stored.get(k), v) for k, v in expected.items() if stored.get(k) != v}
        if mismatched:
            raise ValueError(
                f"cached demos at {path} were collected with other settings "
                f"(stored, requested): {mismatched}; delete the file or use another directory."
            )
        if spec.demos.rescore is not None:
            spec.demos.rescore(demos, options)
        return demos, path, True
    demos = spec.collect_demos(num_episodes, action_noise, seed, progress=progress, **options)
    demos["config"].update(task=task, **cached)
    atomic_write(path, functools.partial(torch.save, demos))
    return demos, path, False
