"""The package's module-level imports form no cycle.

A cycle between timlab's modules means two modules each need the other to be defined first: it
works only by the accident of import order and it hides which module owns what. The graph is read
with ``ast`` from every ``timlab/**/*.py``: an edge A -> B for each import statement in A, at
module level or deferred into a function (a deferred import postpones a cycle, it does not remove
it), except under ``if TYPE_CHECKING``. ``from P import name`` is an edge to ``P.name`` when that
is a module, else to ``P``. tests/test_layout.py reads the same graph with the type-only imports
too, for cycles inside one package folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

import timlab

ROOT = Path(timlab.__file__).parent


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(node: ast.AST, type_checking: bool = False):
    """Every import statement under ``node``, except those under ``if TYPE_CHECKING`` (unless
    ``type_checking``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not type_checking:
            yield from (n for block in child.orelse for n in _imports(ast.Module(body=[block], type_ignores=[])))
        else:
            yield from _imports(child, type_checking)


def import_graph(root: Path = ROOT, *, type_checking: bool = False) -> dict[str, set[str]]:
    """{module: the modules of the package at ``root`` it imports} (``type_checking``: with the
    imports under ``if TYPE_CHECKING``)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")), type_checking):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            edges.update(t for t in targets if t in files and t != mod)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_reports_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_graph_sees_the_package():
    graph = import_graph()
    assert "timlab.trainer.run" in graph and "timlab.config" in graph["timlab.trainer.run"]
    assert len(graph) > 80


def test_no_import_cycle_inside_timlab():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle inside timlab: " + " -> ".join(cycle)
