"""No import cycle among the package's modules.

The graph is built from the ``import`` statements of every module of ``torchrl_flowpolicy``
(those inside functions too, which hide a cycle from an import-time test), read with
:mod:`ast`: ``import a.b`` and ``from a.b import c`` depend on ``a.b``, or on ``a.b.c`` when
``c`` is a submodule. Imports under ``if TYPE_CHECKING:`` never run and are left out, and a
module does not depend on the packages above it (their ``__init__`` runs first, whatever
the module imports).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (under ``root``) by dotted name (a package: its ``__init__``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` at any depth, past ``if TYPE_CHECKING:`` blocks."""
    found, pending = [], [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        children = list(ast.iter_child_nodes(node))
        if _is_type_checking(node):
            children = list(node.orelse)  # the body only runs under a type checker
        pending.extend(children)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring)."""
    modules = module_names(root, package)
    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in modules}
                continue
            base = node.module or ""
            if node.level:  # relative: from the package ``level - 1`` above this one
                anchor = here[: len(here) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names}
            edges |= submodules & set(modules)
            if base in modules and not submodules <= set(modules):
                edges.add(base)  # a name defined in (or re-exported by) ``base`` itself
        graph[name] = edges - {name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: one per strongly connected component with more than
    one module (Tarjan's algorithm), each as the path ``a -> b -> ... -> a`` it contains."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_path(graph, component) for component in components]


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A cycle through the component's first module, as a list of names (first == last)."""
    start, members = component[0], set(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for target in sorted(graph[path[-1]] & members):
            if target == start:
                return [*path, start]
            if target not in seen:
                seen.add(target)
                paths.append([*path, target])
    raise AssertionError(f"no cycle through {start} in {component}")


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT, "torchrl_flowpolicy")
    assert "torchrl_flowpolicy.tasks.registry" in graph and len(graph) > 20
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_graph_sees_function_level_and_relative_imports_and_skips_type_checking(tmp_path):
    package = tmp_path / "toy"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from toy.a import value\n")
    (package / "a.py").write_text("value = 1\n\ndef late():\n    from toy.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("from ..a import value\nfrom . import c\n")
    (package / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import toy.a\n"
    )
    graph = import_graph(tmp_path, "toy")
    assert graph == {
        "toy": {"toy.a"},
        "toy.a": {"toy.sub.b"},
        "toy.sub": set(),
        "toy.sub.b": {"toy.a", "toy.sub.c"},
        "toy.sub.c": set(),
    }
    assert find_cycles(graph) == [["toy.a", "toy.sub.b", "toy.a"]]


def test_find_cycles_reports_each_cycle_once_and_accepts_a_tree():
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    cycles = find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}})
    assert cycles == [["a", "b", "c", "a"], ["d", "e", "d"]]
