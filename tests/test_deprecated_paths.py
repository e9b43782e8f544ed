"""The package's layout: a library at the top, the tasks and the run machinery in their own
subpackages, and the old module paths kept for one release.

* Every old module path (``torchrl_flowpolicy.runs``, ``torchrl_flowpolicy.envs.tasks``, ...)
  imports the very same module as its new path, with a ``DeprecationWarning`` that names the
  new path and points at the importing line; so do the names ``torchrl_flowpolicy.envs``
  used to export and the old top-level modules as attributes.
* The top level holds at most :data:`MAX_TOP_LEVEL` modules and subpackages, no file at an
  old path; ``envs/`` holds no task and no expert, and imports neither the tasks nor the run
  machinery.
* ``import torchrl_flowpolicy`` (``.envs``, ``.tasks``, ``.training``) imports no simulator.
* Nothing in the repository's code, tests and API pages uses an old path (this file aside).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_import_cycles import import_graph

import torchrl_flowpolicy
import torchrl_flowpolicy.envs as envs
import torchrl_flowpolicy.tasks as tasks
from torchrl_flowpolicy.training._moved import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchrl_flowpolicy"
MAX_TOP_LEVEL = 12
MOVED_NAMES = envs._MOVED_NAMES


@pytest.fixture
def forget_old_paths():
    """The old paths leave sys.modules and their parents' attributes (so that an import
    goes through the finder again); restored afterwards."""
    saved_modules = {name: sys.modules.pop(name) for name in MOVED_MODULES if name in sys.modules}
    saved_attributes = {}
    for old in MOVED_MODULES:
        parent, _, child = old.rpartition(".")
        if child in vars(sys.modules[parent]):
            saved_attributes[old] = vars(sys.modules[parent]).pop(child)
    yield
    for name in MOVED_MODULES:
        sys.modules.pop(name, None)
    sys.modules.update(saved_modules)
    for old, value in saved_attributes.items():
        parent, _, child = old.rpartition(".")
        setattr(sys.modules[parent], child, value)


def deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    """The package's deprecation messages among ``caught`` (those of its dependencies,
    imported on the way, left out)."""
    return [
        str(item.message)
        for item in caught
        if item.category is DeprecationWarning
        and str(item.message).startswith("torchrl_flowpolicy.")
    ]


# ----------------------------------------------------------------------------- old paths
@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_the_new_module_with_a_warning(old, forget_old_paths):
    new = MOVED_MODULES[old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # its own identity, kept
    messages = deprecations(caught)
    assert messages == [
        f"{old} is now {new}; import it from there (the old path will be "
        "removed in the next release)."
    ]
    # A second import finds the module in sys.modules: the same object, no new warning.
    assert importlib.import_module(old) is module


def test_the_import_statements_of_old_paths_give_the_same_objects(forget_old_paths):
    from torchrl_flowpolicy.tasks import registry
    from torchrl_flowpolicy.training import checkpoint, runs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torchrl_flowpolicy.runs
        from torchrl_flowpolicy.checkpoint import atomic_write
        from torchrl_flowpolicy.envs.tasks import TASKS, get_task
    assert torchrl_flowpolicy.runs is runs
    assert atomic_write is checkpoint.atomic_write
    assert get_task is registry.get_task and TASKS is registry.TASKS
    messages = deprecations(caught)
    assert len(messages) == 3
    for old, new in [
        ("torchrl_flowpolicy.runs", "torchrl_flowpolicy.training.runs"),
        ("torchrl_flowpolicy.checkpoint", "torchrl_flowpolicy.training.checkpoint"),
        ("torchrl_flowpolicy.envs.tasks", "torchrl_flowpolicy.tasks.registry"),
    ]:
        assert any(message.startswith(f"{old} is now {new};") for message in messages), old
    # The warnings point at the lines above, past the import machinery: Python's default
    # filters then show them when those lines are in __main__.
    ours = [item for item in caught if str(item.message).startswith("torchrl_flowpolicy.")]
    assert {Path(item.filename) for item in ours} == {Path(__file__)}


def test_an_old_top_level_module_as_an_attribute_warns(forget_old_paths):
    from torchrl_flowpolicy.training import statistics

    with pytest.warns(DeprecationWarning, match=r"torchrl_flowpolicy\.training\.statistics"):
        assert torchrl_flowpolicy.statistics is statistics
    with pytest.warns(DeprecationWarning, match=r"torchrl_flowpolicy\.training\.reports"):
        from torchrl_flowpolicy import reports
    assert reports is importlib.import_module("torchrl_flowpolicy.training.reports")
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        torchrl_flowpolicy.no_such_module  # noqa: B018


@pytest.mark.parametrize("name", MOVED_NAMES)
def test_a_name_envs_used_to_export_comes_from_tasks_with_a_warning(name):
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(envs, name)
    assert value is getattr(tasks, name)
    assert deprecations(caught.list) == [
        f"torchrl_flowpolicy.envs.{name} is now torchrl_flowpolicy.tasks.{name}; import it "
        "from there (the old path will be removed in the next release)."
    ]
    assert name not in envs.__all__ and name not in dir(envs)


def test_a_from_import_of_a_moved_name_warns_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from torchrl_flowpolicy.envs import make_pusher_env
    assert make_pusher_env is tasks.make_pusher_env
    (message,) = [item for item in caught if str(item.message).startswith("torchrl_flowpolicy.")]
    assert message.category is DeprecationWarning and Path(message.filename) == Path(__file__)


def test_the_new_names_import_without_a_warning():
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from torchrl_flowpolicy import FlowSDEPolicy, SamplerOptions, load_policy\n"
        "    from torchrl_flowpolicy.envs import BatchedGymEnv, ClampAction, make_chunked_env\n"
        "    from torchrl_flowpolicy.tasks import get_task, make_pusher_env, script_defaults\n"
        "    from torchrl_flowpolicy.training import collectors, models, runs\n"
        "    import torchrl_flowpolicy.tasks.robosuite.env, torchrl_flowpolicy.training.video\n"
        "print([str(item.message) for item in caught if ' is now torchrl_flowpolicy' in "
        "str(item.message)])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- the layout
def top_level() -> list[str]:
    """The package's modules and subpackages (``__init__.py`` left out)."""
    return sorted(
        path.stem if path.suffix == ".py" else path.name
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.name != "__init__.py")
        or (path.is_dir() and (path / "__init__.py").is_file())
    )


def test_the_top_level_is_the_library_and_three_rooms():
    names = top_level()
    assert len(names) <= MAX_TOP_LEVEL, names
    assert {"policy", "sampler", "flow", "objectives", "envs", "tasks", "training"} <= set(names)


def test_no_file_remains_at_an_old_path():
    for old in MOVED_MODULES:
        path = ROOT.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists() and not path.is_dir(), old


def test_envs_holds_no_task_and_imports_neither_tasks_nor_training():
    modules = sorted(path.stem for path in (PACKAGE / "envs").glob("*.py"))
    assert modules == ["__init__", "batched", "chunking", "clamping"]
    graph = import_graph(ROOT, "torchrl_flowpolicy")
    for name, targets in graph.items():
        if name.startswith("torchrl_flowpolicy.envs"):
            outside = {
                target
                for target in targets
                if target.startswith(("torchrl_flowpolicy.tasks", "torchrl_flowpolicy.training"))
            }
            # The package's __getattr__ forwards the old names (the deprecation module only).
            assert outside <= {"torchrl_flowpolicy.training._moved"}, (name, outside)


def test_importing_the_packages_loads_no_simulator():
    # gymnasium and robosuite made unimportable: the packages import all the same, and a
    # task name says which extra it needs (mujoco is left alone: torchrl imports it itself).
    code = (
        "import sys\n"
        "sys.modules['gymnasium'] = sys.modules['robosuite'] = None\n"
        "import torchrl_flowpolicy, torchrl_flowpolicy.envs, torchrl_flowpolicy.tasks\n"
        "import torchrl_flowpolicy.training, torchrl_flowpolicy.tasks.robosuite\n"
        "import torchrl_flowpolicy.tasks.robosuite.layout, torchrl_flowpolicy.tasks.robosuite.registry\n"
        "from torchrl_flowpolicy.training import evaluation, models, protocol, runs\n"
        "try:\n"
        "    from torchrl_flowpolicy.tasks import get_task\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error.name, '[envs]' in str(error))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["gymnasium", "True"]


def test_the_registry_imports_no_robosuite_until_a_factory_runs():
    code = (
        "import sys\n"
        "from torchrl_flowpolicy.tasks import get_task\n"
        "task = get_task('lift')\n"
        "print(task.observation_dim, 'robosuite' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["60", "False"]


# ----------------------------------------------------------------------------- no old path used
_OLD_MODULE = re.compile(
    "|".join(re.escape(old) for old in sorted(MOVED_MODULES, key=len, reverse=True)) + r"(?!\w)"
)
_OLD_NAME = re.compile(rf"torchrl_flowpolicy\.envs\.({'|'.join(MOVED_NAMES)})(?!\w)")
_FROM_IMPORT = re.compile(r"from (torchrl_flowpolicy(?:\.envs)?) import (\([^)]*\)|[^\n]*)")
# What each of the two packages no longer holds, by the name a from-import gives.
_GONE = {
    "torchrl_flowpolicy": {old.rpartition(".")[2] for old in MOVED_MODULES if old.count(".") == 1},
    "torchrl_flowpolicy.envs": {*MOVED_NAMES, *(old.rpartition(".")[2] for old in MOVED_MODULES)},
}


def old_paths(text: str) -> list[str]:
    """The old module paths, old names and from-imports of old names in ``text``."""
    found = [match[0] for match in _OLD_MODULE.finditer(text)]
    found += [match[0] for match in _OLD_NAME.finditer(text)]
    for match in _FROM_IMPORT.finditer(text):
        names = re.findall(r"(\w+)(?:\s+as\s+\w+)?\s*(?:,|\)|#|$)", match[2].strip("()"))
        found += [f"from {match[1]} import {name}" for name in names if name in _GONE[match[1]]]
    return found


def test_the_old_path_finder_sees_each_kind_of_use():
    text = (
        "from torchrl_flowpolicy import FlowSDEPolicy, runs\n"
        "from torchrl_flowpolicy.envs import (\n    make_chunked_env,\n    get_task,\n)\n"
        "x = ':func:`~torchrl_flowpolicy.envs.make_pusher_env`'\n"
        "import torchrl_flowpolicy.video_writing\n"
        "from torchrl_flowpolicy.training import runs\n"
    )
    assert old_paths(text) == [
        "torchrl_flowpolicy.video_writing",
        "torchrl_flowpolicy.envs.make_pusher_env",
        "from torchrl_flowpolicy import runs",
        "from torchrl_flowpolicy.envs import get_task",
    ]


def test_the_repository_uses_no_old_path():
    skipped = {Path(__file__), PACKAGE / "training" / "_moved.py", PACKAGE / "envs" / "__init__.py"}
    files = [
        path
        for folder in ("torchrl_flowpolicy", "examples", "benchmarks", "tests", "scripts")
        for path in (ROOT / folder).rglob("*.py")
        if path not in skipped
    ] + [*(ROOT / "docs" / "api").glob("*.md"), ROOT / "mkdocs.yml"]
    found = [
        f"{path.relative_to(ROOT)}: {use}" for path in files for use in old_paths(path.read_text())
    ]
    assert not found, "old paths in use:\n" + "\n".join(found)
