"""Load ``examples/{name}.py`` as a module from its path (``sys.path`` untouched), for the
tests of the example scripts (:func:`load_example`; the ``example`` fixture of conftest)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/{name}.py`` as a module, loaded from its path (``sys.path`` untouched).

    The scripts import their shared modules by name, as a script's own folder allows:
    ``common`` (the command line), and for the fine-tuning scripts ``pretrain``,
    ``run_settings`` (their settings' checks), ``ppo_learner`` (PPO's learner) and ``dsrl_runs``
    (DSRL's checkpoint); those
    are loaded the same way first and registered under their names, as ``import`` would.
    """
    shared = ("common", "pretrain", "run_settings", "ppo_learner", "dsrl_runs")
    for module_name in dict.fromkeys((*shared, name)):
        path = EXAMPLES / f"{module_name}.py"
        loaded = sys.modules.get(module_name)
        if loaded is not None and getattr(loaded, "__file__", None) == str(path):
            continue
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
