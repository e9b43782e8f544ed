"""The example scripts as modules, for the benchmarks and tests that run an example's own code.

``load_example("ppo")`` loads ``examples/ppo.py`` from its path (``sys.path`` untouched),
after the modules the scripts import by name (:data:`SHARED`), registered under their names
as ``import`` would. ``tests/examples_loader.py`` re-exports it for the tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# What the scripts import by name, as a script's own folder allows, each after those it
# imports: ``run_settings`` (the settings' checks), ``common`` (the command line),
# ``pretrain``, ``ppo_learner`` (PPO's learner) and ``dsrl_runs`` (DSRL's checkpoint).
SHARED = ("run_settings", "common", "pretrain", "ppo_learner", "dsrl_runs")


def load_example(name: str) -> ModuleType:
    """``examples/{name}.py`` as a module, after the shared modules."""
    for module_name in dict.fromkeys((*SHARED, name)):
        path = EXAMPLES / f"{module_name}.py"
        loaded = sys.modules.get(module_name)
        if loaded is not None and getattr(loaded, "__file__", None) == str(path):
            continue
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
