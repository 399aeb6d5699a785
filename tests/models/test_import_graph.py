"""models/ is a tree, not a knot: no import cycle among its modules (imports inside functions
count, `if TYPE_CHECKING:` ones do not) and no private name imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).parents[2] / "models"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every runtime import in `path` (TYPE_CHECKING blocks skipped)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in MODELS.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in MODELS.glob("*.py"):
        edges = set()
        for module, names in _imports(path):
            if module.startswith("models."):
                edges.add(module.split(".")[1])
            elif module == "models":  # a submodule, or a name the package's __init__ gives
                edges.update(n if n in modules else "__init__" for n in names)
        graph[path.stem] = edges & (modules | {"__init__"})
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
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


def test_models_has_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_private_name_crosses_modules_in_models():
    crossing = [
        f"{path.name}: from {module} import {name}"
        for path in sorted(MODELS.glob("*.py"))
        for module, names in _imports(path)
        if module.startswith("models")
        for name in names
        if name.startswith("_")
    ]
    assert crossing == []
