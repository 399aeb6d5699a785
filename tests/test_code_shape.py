"""The shape of the code, read from the source (issue #35's done-when).

No function in the tree (outside tests/, the generated stubs in meshline/, virtual environments
and build/) is 80 lines or longer, decorators excluded. Every function-local import of a
first-party module outside tests/ says why it is not at the module top: a comment on one of its
lines, or on the two lines above the run of import statements it belongs to (one comment heads a
group, e.g. "# in the spawned rank, after run_distributed has set its environment").
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from tests.test_layering import FIRST_PARTY as LAYERING_FIRST_PARTY
from tests.test_layering import ROOT

MAX_FUNCTION_LINES = 80
SKIPPED_TOPS = frozenset({"tests", "meshline", "build"})
"""Top-level folders not scanned (tests, the generated gRPC stubs, build outputs)."""
FIRST_PARTY = frozenset({*LAYERING_FIRST_PARTY, "meshline"})


def _sources() -> list[Path]:
    paths = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in SKIPPED_TOPS or any(p.startswith(".") for p in parts):
            continue
        paths.append(path)
    return paths


SOURCES = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in _sources()}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function of `limit` lines or more; the length runs
    from the `def` line to the last line of the body (decorators excluded)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length >= limit:
                found.append((node.name, node.lineno, length))
    return found


def _is_first_party(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in FIRST_PARTY
    return any(alias.name.split(".")[0] in FIRST_PARTY for alias in node.names)


def _import_runs(function: ast.AST) -> list[list[ast.Import | ast.ImportFrom]]:
    """Runs of consecutive import statements in any statement list inside `function`."""
    runs: list[list[ast.Import | ast.ImportFrom]] = []
    for node in ast.walk(function):
        for field in ("body", "orelse", "finalbody", "handlers"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            run: list[ast.Import | ast.ImportFrom] = []
            for statement in [*statements, None]:
                if isinstance(statement, ast.Import | ast.ImportFrom):
                    run.append(statement)
                    continue
                if run:
                    runs.append(run)
                run = []
    return runs


def unexplained_imports(source: str) -> list[int]:
    """Lines of function-local first-party imports with no comment on their lines or the run's
    lines, nor on the two lines above the run."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    commented = {token.start[0] for token in tokens if token.type == tokenize.COMMENT}
    tree = ast.parse(source)
    bad: set[int] = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for run in _import_runs(function):
            first, last = run[0].lineno, run[-1].end_lineno or run[-1].lineno
            explained = any(line in commented for line in range(first - 2, last + 1))
            if not explained:
                bad.update(node.lineno for node in run if _is_first_party(node))
    return sorted(bad)


def test_scan_sees_the_tree() -> None:
    # A scan that found nothing would pass both rules.
    assert {"engine/engine.py", "training/loop.py", "bench/device_check.py"} <= set(SOURCES)
    assert not any(path.startswith(("tests/", "meshline/")) for path in SOURCES)


def test_long_function_finder() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    source = f"@decorator\ndef long():\n{body}\n\ndef short():\n    return 1\n"
    assert long_functions(source) == [("long", 2, 80)]
    assert long_functions(source, limit=81) == []


def test_unexplained_import_finder() -> None:
    source = (
        "def f():\n"
        "    import json\n"  # not first-party: no reason needed
        "    from models import config\n"  # 3: no comment
        "\n"
        "    x = 1\n"
        "    # after the thread env is set\n"
        "    from kernels import device\n"  # 7: explained above
        "    from engine import build\n"  # 8: same run
        "    y = 2\n"
        "    from training import loop  # lazy: optional\n"  # 10: explained on its line
        "    z = '# not a comment'\n"
        "    w = 3\n"
        "    if x:\n"
        "        from parallel import dims\n"  # 14: no comment (a string's # is not one)
    )
    assert unexplained_imports(source) == [3, 14]


def test_no_function_is_80_lines_or_longer() -> None:
    offenders = [
        f"{path}:{line} {name} ({length} lines)"
        for path, source in SOURCES.items()
        for name, line, length in long_functions(source)
    ]
    assert not offenders, (
        f"functions of {MAX_FUNCTION_LINES} lines or more (split them into single-purpose "
        "helpers):\n" + "\n".join(offenders)
    )


def test_every_function_local_first_party_import_says_why() -> None:
    offenders = [
        f"{path}:{line}" for path, source in SOURCES.items() for line in unexplained_imports(source)
    ]
    assert not offenders, (
        "function-local first-party imports without a reason (move them to the module top, or "
        "write why they stay beside them):\n" + "\n".join(offenders)
    )
