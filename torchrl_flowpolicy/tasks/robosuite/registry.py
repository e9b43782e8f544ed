"""The robosuite tasks' parts of the task registry (:mod:`~torchrl_flowpolicy.tasks.registry`).

:func:`robosuite_factories` gives a robosuite task's environment, expert and demonstration
factories and its rendering options: partials of this module's functions, so that they
pickle (collector processes build the environment from them), and each imports robosuite's
modules only when it runs, so that ``import torchrl_flowpolicy`` never needs robosuite.
:data:`ROBOSUITE_OPTIONS` are the robosuite tasks' option defaults besides the horizon,
:data:`ROBOSUITE_CACHED` the options a demonstration set depends on.

Examples:
    >>> sorted(robosuite_factories("Lift"))
    ['collect_demos', 'make_env', 'make_expert', 'render_options']
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from tensordict.nn import TensorDictModuleBase
from torchrl.envs import EnvBase

__all__ = ["ROBOSUITE_CACHED", "ROBOSUITE_OPTIONS", "robosuite_factories"]


def _robosuite_env(
    task: str,
    num_envs: int | None = None,
    executed_chunk_length: int | None = None,
    **options: Any,
) -> EnvBase:
    from torchrl_flowpolicy.tasks.robosuite.env import make_robosuite_env

    return make_robosuite_env(num_envs, executed_chunk_length, task=task, **options)


def _robosuite_expert(
    task: str, env: EnvBase, action_noise: float = 0.0, seed: int = 0
) -> TensorDictModuleBase:
    # The expert's default settings match the layout make_robosuite_env builds (CanExpert's
    # target is robosuite's default compartment, SquareExpert's peg robosuite's square peg;
    # tests compare them with from_env).
    from torchrl_flowpolicy.tasks.robosuite.experts import EXPERTS, RobosuiteExpertPolicy

    return RobosuiteExpertPolicy(env, EXPERTS[task](action_noise=action_noise, seed=seed))


def _robosuite_demos(
    task: str,
    num_episodes: int,
    action_noise: float,
    seed: int = 0,
    *,
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    from torchrl_flowpolicy.tasks.robosuite.experts import collect_robosuite_demos

    return collect_robosuite_demos(
        num_episodes, action_noise, seed, task=task, progress=progress, **options
    )


def _robosuite_render_options(height: int, width: int, camera: str | None) -> dict[str, Any]:
    # RobosuiteGymEnv's options; its default camera is "frontview".
    options: dict[str, Any] = {
        "render_mode": "rgb_array",
        "render_height": height,
        "render_width": width,
    }
    if camera is not None:
        options["camera_name"] = camera
    return options


def robosuite_factories(task: str) -> dict[str, Any]:
    """The factories and rendering of a robosuite task (picklable: partials of module
    functions, so that collector processes can build the environment)."""
    return {
        "make_env": functools.partial(_robosuite_env, task),
        "make_expert": functools.partial(_robosuite_expert, task),
        "collect_demos": functools.partial(_robosuite_demos, task),
        "render_options": _robosuite_render_options,
    }


ROBOSUITE_OPTIONS = types.MappingProxyType({"reward": "success", "terminate_on_success": True})
ROBOSUITE_CACHED = ("max_episode_steps", "reward", "terminate_on_success")
