"""services/common's operation jobs reach the store through an interface, not its module.

Import cycles and private cross-module imports across the whole tree (lazy imports included) are
checked by tests/test_layering.py; this file pins the one design choice that broke the
operation_jobs <-> operations cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

COMMON = Path(__file__).resolve().parents[3] / "services" / "common"


def test_operation_jobs_does_not_know_the_store_module() -> None:
    tree = ast.parse((COMMON / "operation_jobs.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert modules, "no imports read"
    assert "services.common.operations" not in modules, "not even under TYPE_CHECKING"
