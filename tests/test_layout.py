"""The package's modules and classes stay small: one concept per module.

Every module under ``torchrl_flowpolicy/`` has at most :data:`MAX_MODULE_LINES` lines and
every class (nested ones included) spans at most :data:`MAX_CLASS_LINES` lines, measured
with :mod:`ast` from its first decorator to its last line. A module that grows past the
limit is split along its concepts (see ``DESIGN.md``, section 2), not trimmed of its
docstrings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchrl_flowpolicy"
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 320


def module_lines(path: Path) -> int:
    """The number of lines of the file at ``path`` (as ``wc -l`` counts a final newline)."""
    return len(path.read_text().splitlines())


def class_spans(source: str, filename: str = "<source>") -> dict[str, int]:
    """Each class of ``source`` (dotted by its enclosing classes and functions) and its span
    in lines, decorators included."""
    spans: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                if isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    spans[name] = child.end_lineno - first + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename), "")
    return spans


MODULES = sorted(str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py"))


def test_the_package_has_modules():
    assert len(MODULES) > 10, f"found only {MODULES} under {PACKAGE}"


@pytest.mark.parametrize("module", MODULES)
def test_module_is_at_most_450_lines(module):
    lines = module_lines(ROOT / module)
    assert lines <= MAX_MODULE_LINES, (
        f"{module} has {lines} lines, more than {MAX_MODULE_LINES}: split it along its concepts."
    )


@pytest.mark.parametrize("module", MODULES)
def test_every_class_is_at_most_320_lines(module):
    path = ROOT / module
    too_long = {
        name: span
        for name, span in class_spans(path.read_text(), str(path)).items()
        if span > MAX_CLASS_LINES
    }
    assert not too_long, f"classes of {module} over {MAX_CLASS_LINES} lines: {too_long}"


def test_class_spans_count_decorators_nested_classes_and_classes_in_functions():
    source = (
        "import dataclasses\n"  # 1
        "@dataclasses.dataclass\n"  # 2
        "class Outer:\n"  # 3
        "    x: int = 0\n"  # 4
        "    class Inner:\n"  # 5
        "        pass\n"  # 6
        "def factory():\n"  # 7
        "    class Local:\n"  # 8
        "        a = 1\n"  # 9
        "        b = 2\n"  # 10
        "    return Local\n"  # 11
    )
    assert class_spans(source) == {"Outer": 5, "Outer.Inner": 2, "factory.Local": 3}


def test_the_limits_catch_a_long_module_and_a_long_class(tmp_path):
    body = "\n".join(f"    attribute_{index} = {index}" for index in range(MAX_CLASS_LINES))
    path = tmp_path / "long.py"
    path.write_text(f"class Long:\n{body}\n" + "\n" * (MAX_MODULE_LINES - MAX_CLASS_LINES))
    assert class_spans(path.read_text())["Long"] == MAX_CLASS_LINES + 1
    assert module_lines(path) == MAX_MODULE_LINES + 1
