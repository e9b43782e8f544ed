"""The example scripts as modules, for the benchmarks that time an example's own code.

``load_example("ppo")`` loads ``examples/ppo.py`` from its path (``sys.path`` untouched),
after the modules it imports by name (``common``, ``pretrain``, ``run_settings``), registered under their names
as ``import`` would.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/{name}.py`` as a module."""
    for module_name in dict.fromkeys(("common", "pretrain", "run_settings", name)):
        path = EXAMPLES / f"{module_name}.py"
        loaded = sys.modules.get(module_name)
        if loaded is not None and getattr(loaded, "__file__", None) == str(path):
            continue
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
