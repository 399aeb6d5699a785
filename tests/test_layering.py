"""The layering rule of docs/architecture.md, read from the source (imports inside functions count).

Libraries (kernels, models, tokendata, checkpoints, parallel, engine, training) never import
`services`, and each imports only the libraries below it (engine and training sit side by side and
do not import each other). A library owns the typed config it reads: no parameter of `parallel/`
or `training/` that takes a config is typed `Any`. A stage folder `services/<a>/` imports `services.common`,
itself and libraries, never another stage. Only the composition layer (`services/cli.py`,
`services/serve.py`, `services/demos/`, `services/estimate_trial.py`) may import several stages. No import cycle anywhere (an
import under `if TYPE_CHECKING:` is not a runtime edge and does not count); no `_private` name of
one first-party module imported by another. `services/*` build engines only through
`engine.build.build_engine`: no service constructs an engine class or imports the loader or the
parallel engine builders. The trainer service stays thin: under `TRAINER_LINE_BUDGET` lines, and
no function in it or in `services/common` of `MAX_FUNCTION_LINES` lines or more.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LIBRARY_DEPS: dict[str, frozenset[str]] = {
    "kernels": frozenset(),
    "models": frozenset({"kernels"}),
    "tokendata": frozenset({"kernels", "models"}),
    "checkpoints": frozenset({"kernels", "models"}),
    "parallel": frozenset({"kernels", "models"}),
    "engine": frozenset({"kernels", "models", "tokendata", "checkpoints", "parallel"}),
    "training": frozenset({"kernels", "models", "tokendata", "checkpoints", "parallel"}),
}
"""Each library and the libraries it may import (the layer order, bottom first)."""

STAGES = ("preprocess", "trainer", "converter", "inference", "evaluator")
COMPOSITION = ("services.cli", "services.serve", "services.demos", "services.estimate_trial")
"""Modules that chain stages: the only ones under services/ that may import several."""
FIRST_PARTY = (*LIBRARY_DEPS, "services", "meshline_client")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    """Dotted module (or module.name) imported."""
    names: tuple[str, ...]
    line: int
    type_checking: bool


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path) -> list[Import]:
    module = _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, (), node.lineno, node.lineno in guarded))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, path).split(".")
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names = tuple(alias.name for alias in node.names)
            found.append(Import(module, base, names, node.lineno, node.lineno in guarded))
    return found


def _sources() -> dict[str, Path]:
    modules = {}
    for top in FIRST_PARTY:
        for path in sorted((ROOT / top).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _extensions() -> dict[str, Path]:
    """Compiled extension modules (a `.c` source in a package, built by pyproject's ext-modules):
    modules with no Python imports."""
    return {
        _module_name(path.with_suffix(".py")): path
        for top in FIRST_PARTY
        for path in sorted((ROOT / top).rglob("*.c"))
    }


EXTENSIONS = _extensions()
MODULES = {**_sources(), **EXTENSIONS}
IMPORTS = {name: [] if name in EXTENSIONS else _imports(path) for name, path in MODULES.items()}


def _resolve(dotted: str) -> str | None:
    """The first-party module a dotted import lands in (`a.b.name` -> `a.b`)."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _targets(imp: Import) -> set[str]:
    """First-party modules an import statement loads (each `from pkg import mod` counts mod)."""
    out = set()
    for name in imp.names or ("",):
        full = f"{imp.target}.{name}" if name else imp.target
        hit = full if full in MODULES else _resolve(imp.target)
        if hit:
            out.add(hit)
    return out


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 2 and parts[1] in STAGES else None


def test_scan_sees_the_tree() -> None:
    # A scan that found nothing would pass every rule below.
    assert {"engine.engine", "checkpoints.hf_format", "parallel.tensor_parallel"} <= set(MODULES)
    assert sum(len(found) for found in IMPORTS.values()) > 500


def test_libraries_never_import_services_and_keep_their_layer() -> None:
    bad = []
    for module, found in IMPORTS.items():
        top = module.split(".")[0]
        if top not in LIBRARY_DEPS:
            continue
        for imp in found:
            other = imp.target.split(".")[0]
            if other == "services" or (
                other in LIBRARY_DEPS and other != top and other not in LIBRARY_DEPS[top]
            ):
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{imp.line} imports {imp.target}")
    assert not bad, "library imports outside its layer:\n" + "\n".join(bad)


def test_training_and_engine_are_libraries_apart_from_services_and_each_other() -> None:
    assert {
        "training.loop",
        "training.objectives",
        "training.deepspeed_config",
        "engine.engine",
    } <= set(MODULES)
    bad = [
        f"{MODULES[module].relative_to(ROOT)}:{imp.line} imports {imp.target}"
        for module, found in IMPORTS.items()
        for imp in found
        if module.split(".")[0] in ("training", "engine")
        and imp.target.split(".")[0]
        in ({"services", "training", "engine"} - {module.split(".")[0]})
    ]
    assert not bad, "training/engine import a service or each other:\n" + "\n".join(bad)


CONFIG_PARAMS = ("config", "par", "cfg")
"""Parameter names (also `*_config`) that carry a configuration."""


def _any_typed_config_params(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            is_config = arg.arg in CONFIG_PARAMS or arg.arg.endswith("_config")
            if is_config and arg.annotation is not None:
                parts = ast.unparse(arg.annotation).strip("'\"").split("|")
                if "Any" in (part.strip() for part in parts):
                    found.append(f"{path.name}:{arg.lineno} {node.name}({arg.arg})")
    return found


def test_library_config_parameters_are_typed() -> None:
    bad = [hit for top in ("parallel", "training") for path in sorted((ROOT / top).rglob("*.py"))
           for hit in _any_typed_config_params(path)]  # fmt: skip
    assert not bad, (
        "config parameters typed Any (type them with the library's config):\n" + "\n".join(bad)
    )


def test_config_scan_finds_an_any_typed_config(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(par: Any, model_config: 'Any | None', ok: Any, cfg: dict[str, Any]) -> None: ...\n"
    )
    assert [hit.split()[-1] for hit in _any_typed_config_params(sample)] == [
        "f(par)",
        "f(model_config)",
    ]


def test_no_stage_imports_another_stage() -> None:
    bad = []
    for module, found in IMPORTS.items():
        stage = _stage(module)
        for imp in found:
            parts = imp.target.split(".")
            if parts[0] != "services":
                continue
            if stage is not None:
                target_stage = _stage(imp.target + ".x") if len(parts) == 2 else _stage(imp.target)
                allowed = target_stage in (None, stage) and not imp.target.startswith(COMPOSITION)
            elif module.startswith(("services.common", "meshline_client")):
                allowed = imp.target.startswith("services.common")
            else:
                allowed = True
            if not allowed:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{imp.line} imports {imp.target}")
    assert not bad, "cross-service imports:\n" + "\n".join(bad)


def test_no_private_name_imported_across_modules() -> None:
    bad = []
    for module, found in IMPORTS.items():
        for imp in found:
            if imp.target.split(".")[0] not in FIRST_PARTY:
                continue
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{MODULES[module].relative_to(ROOT)}:{imp.line} {name}")
    assert not bad, "private names imported from other modules:\n" + "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    edges: dict[str, set[str]] = {module: set() for module in MODULES}
    for module, found in IMPORTS.items():
        for imp in found:
            if not imp.type_checking:
                edges[module] |= _targets(imp) - {module}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("library", sorted(LIBRARY_DEPS))
def test_every_library_is_packaged(library: str) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"{library}*"' in pyproject, f"{library} missing from [tool.setuptools.packages.find]"


ENGINE_CLASSES = frozenset({"Engine", "LeaderFollowerEngine", "PipelineEngine"})
"""Engine classes a service must not construct itself (build_engine does)."""
ENGINE_BUILDING = frozenset(
    {
        "engine.loading.load_checkpoint",
        "engine.parallel_engine",
        "engine.pipeline_engine",
        "engine.tensor_parallel",
    }
)
"""What builds an engine from parts: the checkpoint loader and the parallel wrappers."""


def _engine_constructions(source: str) -> list[int]:
    """Lines of `source` that call an engine class (`Engine(...)`, `x.Engine(...)`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ENGINE_CLASSES:
                lines.append(node.lineno)
    return lines


def test_engine_construction_finder_finds_one() -> None:
    assert _engine_constructions("e = Engine(model, tokens)\nf = engine.PipelineEngine(m)") == [
        1,
        2,
    ]


def test_services_build_engines_only_through_build_engine() -> None:
    bad = []
    for module, path in MODULES.items():
        if not module.startswith("services.") or module in EXTENSIONS:
            continue
        bad += [
            f"{module}:{line} constructs an engine"
            for line in _engine_constructions(path.read_text())
        ]
        for imp in IMPORTS[module]:
            for name in imp.names or ("",):
                full = f"{imp.target}.{name}" if name else imp.target
                if any(full == b or full.startswith(b + ".") for b in ENGINE_BUILDING):
                    bad.append(f"{module}:{imp.line} imports {full}")
    assert not bad, "build engines with engine.build.build_engine:\n" + "\n".join(bad)


TRAINER_LINE_BUDGET = 3_000
"""Lines of Python `services/trainer/` may hold (issue #35: no bigger than the other stages)."""
MAX_FUNCTION_LINES = 80
"""A function this long or longer in the thin service folders is split into helpers."""
THIN_FOLDERS = ("services/trainer", "services/common")


def test_trainer_service_stays_under_its_line_budget() -> None:
    """The trainer service is config, CLI, servicer, launchers and job plumbing over the training
    library (docs/architecture.md, "The trainer service stays thin"). It once held the library
    itself (6,211 lines: the DeepSpeed mapping, the dry-run arithmetic, the pre-launch checks,
    Kubernetes workloads); code that makes it grow past the budget is library code that belongs
    in `training/` (or, when any stage could use it, in `services/common/`)."""
    lines = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in sorted((ROOT / "services" / "trainer").rglob("*.py"))
    }
    total = sum(lines.values())
    largest = sorted(lines.items(), key=lambda item: -item[1])[:5]
    assert total < TRAINER_LINE_BUDGET, (
        f"services/trainer holds {total} lines (budget {TRAINER_LINE_BUDGET}); move library code "
        f"out (largest files: {largest})"
    )


def _long_functions(source: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function of `limit` lines or more in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length >= limit:
                found.append((node.name, node.lineno, length))
    return found


def test_long_function_finder_finds_one() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    assert _long_functions(f"def f():\n{body}\ndef g():\n    pass\n", 6) == [("f", 1, 6)]


def test_thin_service_folders_have_no_long_functions() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for folder in THIN_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name, line, length in _long_functions(path.read_text(), MAX_FUNCTION_LINES)
    ]
    assert not bad, (
        f"functions of {MAX_FUNCTION_LINES}+ lines (split them into single-purpose helpers):\n"
        + "\n".join(bad)
    )
