"""Environment tools for any TorchRL environment: chunked execution, action bounds and
batched gymnasium environments.

:mod:`~torchrl_flowpolicy.envs.chunking` runs one policy decision as a chunk of ``H'``
environment steps (:func:`make_chunked_env`, :class:`ChunkedAction`,
:func:`decision_discount`), :mod:`~torchrl_flowpolicy.envs.clamping` clamps the executed
action to the environment's bounds (:class:`ClampAction`) and
:mod:`~torchrl_flowpolicy.envs.batched` puts several gymnasium environments behind one
batch-locked TorchRL environment (:class:`BatchedGymEnv`). The benchmark tasks, their
experts and demonstrations are in :mod:`torchrl_flowpolicy.tasks`.

Every name below is imported on first use, from its module: :func:`make_chunked_env`,
:class:`ChunkedAction`, :class:`ClampAction` and :func:`decision_discount` need TorchRL only,
:class:`BatchedGymEnv` needs gymnasium (``pip install "torchrl_flowpolicy[envs]"``). The
task names this package used to export (``make_pusher_env``, ``get_task``, ...) still
resolve, from :mod:`torchrl_flowpolicy.tasks`, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchrl_flowpolicy.envs.batched import BatchedGymEnv
    from torchrl_flowpolicy.envs.chunking import (
        ChunkedAction,
        decision_discount,
        make_chunked_env,
    )
    from torchrl_flowpolicy.envs.clamping import ClampAction

# Each public name and the submodule that defines it.
_SOURCES = {
    "BatchedGymEnv": "batched",
    "ChunkedAction": "chunking",
    "ClampAction": "clamping",
    "decision_discount": "chunking",
    "make_chunked_env": "chunking",
}
# The names this package exported before the tasks moved to torchrl_flowpolicy.tasks.
_MOVED_NAMES = (
    "collect_demos",
    "demos_path",
    "load_or_collect_demos",
    "PusherTask",
    "is_success",
    "make_pusher_env",
    "object_goal_distance",
    "PusherExpert",
    "PusherExpertPolicy",
    "TASKS",
    "DemoSettings",
    "Task",
    "get_task",
)
_SIMULATORS = ("gymnasium", "mujoco", "robosuite")


def import_lazily(package: str, sources: dict[str, str], name: str, extras: str) -> Any:
    """``name`` imported from ``package``'s submodule ``sources[name]`` (the PEP 562
    ``__getattr__`` of ``envs`` and ``tasks``); a missing simulator raises a
    ``ModuleNotFoundError`` naming the ``pip install`` of ``extras``."""
    if name not in sources:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{package}.{sources[name]}")
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] in _SIMULATORS:
            raise ModuleNotFoundError(
                f"{package}.{name} needs {error.name!r}, which is not installed: "
                f"pip install {extras}.",
                name=error.name,
            ) from error
        raise
    return getattr(module, name)


def __getattr__(name: str) -> Any:
    """Import a public name from its submodule on first use (PEP 562); a name that moved to
    :mod:`torchrl_flowpolicy.tasks` (or an old submodule) with a ``DeprecationWarning``."""
    from torchrl_flowpolicy.training import _moved

    if name in _MOVED_NAMES:
        caller = sys._getframe(1).f_code.co_filename
        if not ("importlib" in caller and "_bootstrap" in caller):  # not from-import's probe
            _moved.warn_moved(f"{__name__}.{name}", f"torchrl_flowpolicy.tasks.{name}")
        return getattr(importlib.import_module("torchrl_flowpolicy.tasks"), name)
    if f"{__name__}.{name}" in _moved.MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    value = import_lazily(__name__, _SOURCES, name, "'torchrl_flowpolicy[envs]'")
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
]
