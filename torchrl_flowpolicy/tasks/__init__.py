"""The benchmark tasks: their environments, scripted experts, demonstrations and the registry
the examples read.

:mod:`~torchrl_flowpolicy.tasks.registry` is the registry of the tasks the examples run
(``"pusher"``, robosuite's ``"lift"``, ``"can"`` and ``"square"``): each :class:`Task` holds
all that differs between them (:func:`get_task`, :data:`TASKS`, :class:`DemoSettings`,
:func:`script_defaults`). :mod:`~torchrl_flowpolicy.tasks.demonstrations` caches any task's
demonstrations.

The default task, gymnasium's Pusher, is split by concept in
:mod:`torchrl_flowpolicy.tasks.pusher`: :mod:`~torchrl_flowpolicy.tasks.pusher.env` (task
facts, success test, :class:`PusherTask`, :func:`make_pusher_env`),
:mod:`~torchrl_flowpolicy.tasks.pusher.expert` (the scripted :class:`PusherExpert`) and
:mod:`~torchrl_flowpolicy.tasks.pusher.demos` (rolling it out into demonstrations).

robosuite's tasks, in :mod:`torchrl_flowpolicy.tasks.robosuite`, are imported only when used:
:mod:`~torchrl_flowpolicy.tasks.robosuite.layout` (the task specifications and observation
layout), :mod:`~torchrl_flowpolicy.tasks.robosuite.registry` (their registry entries'
factories), :mod:`~torchrl_flowpolicy.tasks.robosuite.env` (the environments),
:mod:`~torchrl_flowpolicy.tasks.robosuite.lift_expert`,
:mod:`~torchrl_flowpolicy.tasks.robosuite.can_expert` and
:mod:`~torchrl_flowpolicy.tasks.robosuite.square_expert` (the scripted experts, sharing
:mod:`~torchrl_flowpolicy.tasks.robosuite.expert_base`),
:mod:`~torchrl_flowpolicy.tasks.robosuite.experts` (the experts as policies and
demonstrations), :mod:`~torchrl_flowpolicy.tasks.robosuite.quiet_logging` (robosuite's log)
and :mod:`~torchrl_flowpolicy.tasks.robosuite.can_outcomes` (why PickPlaceCan episodes
failed).

Every name below is imported on first use, from its module, so ``import
torchrl_flowpolicy.tasks`` imports no simulator; the names need gymnasium and MuJoCo
(``pip install "torchrl_flowpolicy[envs]"``), robosuite's tasks the ``[robosuite]`` extra
when one of their factories runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrl_flowpolicy.envs import import_lazily

if TYPE_CHECKING:
    from torchrl_flowpolicy.tasks.demonstrations import demos_path, load_or_collect_demos
    from torchrl_flowpolicy.tasks.pusher.demos import collect_demos
    from torchrl_flowpolicy.tasks.pusher.env import (
        PusherTask,
        is_success,
        make_pusher_env,
        object_goal_distance,
    )
    from torchrl_flowpolicy.tasks.pusher.expert import PusherExpert, PusherExpertPolicy
    from torchrl_flowpolicy.tasks.registry import (
        TASKS,
        DemoSettings,
        Task,
        get_task,
        script_defaults,
    )

# Each public name and the submodule that defines it.
_SOURCES = {
    "collect_demos": "pusher.demos",
    "demos_path": "demonstrations",
    "load_or_collect_demos": "demonstrations",
    "PusherTask": "pusher.env",
    "is_success": "pusher.env",
    "make_pusher_env": "pusher.env",
    "object_goal_distance": "pusher.env",
    "PusherExpert": "pusher.expert",
    "PusherExpertPolicy": "pusher.expert",
    "TASKS": "registry",
    "DemoSettings": "registry",
    "Task": "registry",
    "get_task": "registry",
    "script_defaults": "registry",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its submodule on first use (PEP 562)."""
    extras = "'torchrl_flowpolicy[envs]' (robosuite's tasks: '[robosuite]')"
    value = import_lazily(__name__, _SOURCES, name, extras)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Task",
    "DemoSettings",
    "TASKS",
    "get_task",
    "script_defaults",
    "PusherTask",
    "make_pusher_env",
    "object_goal_distance",
    "is_success",
    "PusherExpert",
    "PusherExpertPolicy",
    "collect_demos",
    "demos_path",
    "load_or_collect_demos",
]
