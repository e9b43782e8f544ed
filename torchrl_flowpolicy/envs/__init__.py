"""Environments: chunked execution, batched gymnasium environments and the default task.

The default task is split by concept: :mod:`~torchrl_flowpolicy.envs.pusher` (task facts,
success test, :class:`PusherTask`, :func:`make_pusher_env`),
:mod:`~torchrl_flowpolicy.envs.pusher_expert` (the scripted :class:`PusherExpert`) and
:mod:`~torchrl_flowpolicy.envs.pusher_demos` (rolling it out into demonstrations).
:mod:`~torchrl_flowpolicy.envs.tasks` is the registry of the tasks the examples run
(``"pusher"``, robosuite's ``"lift"``, ``"can"`` and ``"square"``): each :class:`Task` holds all that
differs between them; their robosuite parts are imported only when used:
:mod:`~torchrl_flowpolicy.envs.robosuite_layout` (the task specifications and observation
layout), :mod:`~torchrl_flowpolicy.envs.robosuite_tasks` (the environments),
:mod:`~torchrl_flowpolicy.envs.lift_expert`, :mod:`~torchrl_flowpolicy.envs.can_expert` and
:mod:`~torchrl_flowpolicy.envs.square_expert` (the scripted experts, sharing :mod:`~torchrl_flowpolicy.envs.robosuite_expert_base`) and
:mod:`~torchrl_flowpolicy.envs.robosuite_experts` (the experts as policies and
demonstrations); :mod:`~torchrl_flowpolicy.envs.can_outcomes` sorts PickPlaceCan episodes by
why they failed.
:mod:`~torchrl_flowpolicy.envs.demonstrations` caches any task's demonstrations.

Every name below is imported on first use, from its module: :func:`make_chunked_env`,
:class:`ChunkedAction`, :class:`ClampAction` and :func:`decision_discount` need TorchRL only,
the rest needs the simulators (``pip install "torchrl_flowpolicy[envs]"``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchrl_flowpolicy.envs.batched import BatchedGymEnv
    from torchrl_flowpolicy.envs.chunking import (
        ChunkedAction,
        ClampAction,
        decision_discount,
        make_chunked_env,
    )
    from torchrl_flowpolicy.envs.demonstrations import demos_path, load_or_collect_demos
    from torchrl_flowpolicy.envs.pusher import (
        PusherTask,
        is_success,
        make_pusher_env,
        object_goal_distance,
    )
    from torchrl_flowpolicy.envs.pusher_demos import collect_demos
    from torchrl_flowpolicy.envs.pusher_expert import PusherExpert, PusherExpertPolicy
    from torchrl_flowpolicy.envs.tasks import TASKS, DemoSettings, Task, get_task

# Each public name and the submodule that defines it.
_SOURCES = {
    "BatchedGymEnv": "batched",
    "ChunkedAction": "chunking",
    "ClampAction": "clamping",
    "decision_discount": "chunking",
    "make_chunked_env": "chunking",
    "collect_demos": "pusher_demos",
    "demos_path": "demonstrations",
    "load_or_collect_demos": "demonstrations",
    "PusherTask": "pusher",
    "is_success": "pusher",
    "make_pusher_env": "pusher",
    "object_goal_distance": "pusher",
    "PusherExpert": "pusher_expert",
    "PusherExpertPolicy": "pusher_expert",
    "TASKS": "tasks",
    "DemoSettings": "tasks",
    "Task": "tasks",
    "get_task": "tasks",
}
_SIMULATORS = ("gymnasium", "mujoco", "robosuite")


def __getattr__(name: str) -> Any:
    """Import a public name from its submodule on first use (PEP 562)."""
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{_SOURCES[name]}")
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] in _SIMULATORS:
            raise ModuleNotFoundError(
                f"{__name__}.{name} needs {error.name!r}, which is not installed: "
                "pip install 'torchrl_flowpolicy[envs]' (robosuite's tasks: '[robosuite]').",
                name=error.name,
            ) from error
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BatchedGymEnv",
    "ChunkedAction",
    "ClampAction",
    "make_chunked_env",
    "decision_discount",
    "PusherExpert",
    "PusherExpertPolicy",
    "PusherTask",
    "make_pusher_env",
    "collect_demos",
    "demos_path",
    "load_or_collect_demos",
    "object_goal_distance",
    "is_success",
    "Task",
    "DemoSettings",
    "TASKS",
    "get_task",
]
