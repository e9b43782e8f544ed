"""The package's old module paths, kept for one release: each imports its new module, with a
``DeprecationWarning`` naming the new path.

The run machinery moved from the top level into :mod:`torchrl_flowpolicy.training` and the
benchmark tasks from :mod:`torchrl_flowpolicy.envs` into :mod:`torchrl_flowpolicy.tasks`
(:data:`MOVED_MODULES`). No file remains at an old path: :class:`MovedModuleFinder`, on
``sys.meta_path`` from ``import torchrl_flowpolicy`` on, answers for each old dotted name
with the new module itself, so ``torchrl_flowpolicy.runs.save_run is
torchrl_flowpolicy.training.runs.save_run``. :func:`warn_moved` points the warning at the
line that imported the old path (past the import machinery), so that Python's default
filters show it when that line is in ``__main__``.

Examples:
    >>> import warnings
    >>> from torchrl_flowpolicy.training import runs
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     old = moved_module("torchrl_flowpolicy.runs")
    >>> old is runs, str(caught[0].message).split(";")[0]
    (True, 'torchrl_flowpolicy.runs is now torchrl_flowpolicy.training.runs')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MOVED_MODULES", "MovedModuleFinder", "install", "moved_module", "warn_moved"]

_TRAINING = (
    "checkpoint",
    "collectors",
    "data",
    "distributed",
    "episodes",
    "evaluation",
    "gaussian_baseline",
    "loggers",
    "models",
    "protocol",
    "reports",
    "run_checks",
    "runs",
    "statistics",
    "video",
    "video_writing",
)
_TASKS = {
    "tasks": "registry",
    "demonstrations": "demonstrations",
    "pusher": "pusher.env",
    "pusher_expert": "pusher.expert",
    "pusher_demos": "pusher.demos",
    "robosuite_layout": "robosuite.layout",
    "robosuite_registry": "robosuite.registry",
    "robosuite_tasks": "robosuite.env",
    "robosuite_expert_base": "robosuite.expert_base",
    "robosuite_experts": "robosuite.experts",
    "robosuite_logging": "robosuite.quiet_logging",
    "lift_expert": "robosuite.lift_expert",
    "can_expert": "robosuite.can_expert",
    "square_expert": "robosuite.square_expert",
    "can_outcomes": "robosuite.can_outcomes",
}

#: Old dotted module name -> its new one.
MOVED_MODULES: dict[str, str] = {
    **{f"torchrl_flowpolicy.{name}": f"torchrl_flowpolicy.training.{name}" for name in _TRAINING},
    **{
        f"torchrl_flowpolicy.envs.{old}": f"torchrl_flowpolicy.tasks.{new}"
        for old, new in _TASKS.items()
    },
}

# The modules whose frames forward an old path, and the import machinery's files.
_FORWARDING = ("torchrl_flowpolicy", "torchrl_flowpolicy.envs", __name__)
_IMPORTLIB = (str(Path(importlib.__file__).parent), "<frozen importlib")


def _caller() -> types.FrameType:
    """The frame that asked for the old path: the first one outside the import machinery and
    the forwarding code."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_IMPORTLIB)
        or frame.f_globals.get("__name__") in _FORWARDING
    ):
        frame = frame.f_back
    return frame


def warn_moved(old: str, new: str) -> None:
    """A ``DeprecationWarning`` that ``old`` is now ``new``, attributed to the caller's line."""
    frame = _caller()
    module_globals = frame.f_globals
    warnings.warn_explicit(
        f"{old} is now {new}; import it from there (the old path will be removed in the "
        "next release).",
        DeprecationWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )


def moved_module(old: str) -> types.ModuleType:
    """The new module of the old dotted name ``old``, with the warning."""
    warn_moved(old, MOVED_MODULES[old])
    return importlib.import_module(MOVED_MODULES[old])


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old path as its new module: the very same module object, not a copy."""

    def __init__(self) -> None:
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = moved_module(spec.name)
        self._spec = module.__spec__  # the import system then sets __spec__ to the old one
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._spec  # the module keeps its own spec (and name)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds each old dotted name of :data:`MOVED_MODULES` (and nothing else)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader())


def install() -> None:
    """Put one :class:`MovedModuleFinder` on ``sys.meta_path`` (after the others: an old path
    holds no file, so no other finder answers for it)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
