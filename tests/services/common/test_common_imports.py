"""services/common has no import cycle, counting imports inside functions (not TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

COMMON = Path(__file__).resolve().parents[3] / "services" / "common"
PACKAGE = "services.common"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST) -> set[str]:
    """Modules of services.common imported anywhere in `tree`, outside `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE + "."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {f"{PACKAGE}.{path.stem}": path for path in COMMON.glob("*.py")}
    return {
        name: _imported(ast.parse(path.read_text())) & set(modules)
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_services_common() -> None:
    graph = _graph()
    assert f"{PACKAGE}.operations" in graph[f"{PACKAGE}.jobs"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_operation_jobs_does_not_know_the_store_module() -> None:
    tree = ast.parse((COMMON / "operation_jobs.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert f"{PACKAGE}.operations" not in modules, "not even under TYPE_CHECKING"


def test_the_checker_sees_lazy_imports() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.common.server import X\n"
        "def f():\n    from services.common import jobs\n"
    )
    assert _imported(tree) == {"services.common.jobs"}
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
