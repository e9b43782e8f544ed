"""Load ``examples/{name}.py`` as a module from its path (``sys.path`` untouched), for the
tests of the example scripts (the ``example`` fixture of conftest): the benchmarks' loader,
``benchmarks/example_scripts.py``, loaded from its path, so that tests and benchmarks load the
scripts one way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "example_scripts.py"
_spec = importlib.util.spec_from_file_location("_example_scripts", _PATH)
_example_scripts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example_scripts)

load_example = _example_scripts.load_example
EXAMPLES = _example_scripts.EXAMPLES

__all__ = ["EXAMPLES", "load_example"]
