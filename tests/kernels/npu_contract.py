"""torch_npu's documented op contract, read from the installed wheel without importing it.

`make setup` installs the torch_npu release paired with the pinned torch into
`.venv/torch_npu-reference` (outside sys.path: it cannot be imported without CANN). Its
`_op_plugin_docs.py` holds one prototype per op, e.g.

    torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)

and `optim/npu_fused_adamw.py` the fused optimizer's constructor. This module turns those into
`inspect.Signature`s that calls can be bound to, and lists every `torch_npu.*` call Meshline's
product code makes (by reading its source), so a renamed argument, a wrong position or an
undocumented op fails on a CPU-only machine.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS_ENV = "MESHLINE_TORCH_NPU_REFERENCE"
PRODUCT_DIRS = (
    "kernels",
    "models",
    "tokendata",
    "checkpoints",
    "parallel",
    "engine",
    "training",
    "services",
)

_PROTOTYPE = re.compile(r"^(?:torch_npu\.)?(npu_\w+)\((.*)\)\s*->\s*(.+)$")
# "Tensor? pse=None", "int[]? prefix=None", "Tensor(a!) out", or an untyped "self".
_PARAM = re.compile(r"^(?:(?P<type>\S+)\s+)?(?P<name>\w+)(?:\s*=\s*(?P<default>.+))?$")


def reference_root() -> Path | None:
    """The directory holding the installed `torch_npu/` package, or None when absent."""
    configured = os.environ.get(DOCS_ENV)
    candidates = [Path(configured)] if configured else []
    candidates.append(Path(sys.prefix) / "torch_npu-reference")
    for root in candidates:
        if (root / "torch_npu" / "_op_plugin_docs.py").is_file():
            return root
    return None


def _default(text: str) -> object:
    text = text.strip()
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if text[:1] in "\"'":
        return text[1:-1]
    if text.startswith("["):
        return [_default(item) for item in text[1:-1].split(",") if item.strip()]
    try:
        return int(text)
    except ValueError:
        return float(text)


@dataclass(frozen=True)
class Prototype:
    """One documented op: its name, signature, declared parameter types and return text."""

    name: str
    signature: inspect.Signature
    types: dict[str, str]
    returns: str


def parse_prototype(line: str) -> Prototype | None:
    """The prototype on one docs line, or None when the line is not one we can parse."""
    match = _PROTOTYPE.match(line.strip())
    if match is None:
        return None
    name, params_text, returns = match.groups()
    params: list[inspect.Parameter] = []
    types: dict[str, str] = {}
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for item in _split_params(params_text):
        if item == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        param = _PARAM.match(item)
        if param is None:
            return None  # a prototype in another notation; the ops Meshline calls must parse
        default = inspect.Parameter.empty
        if param["default"] is not None:
            try:
                default = _default(param["default"])
            except ValueError:
                return None
        params.append(inspect.Parameter(param["name"], kind, default=default))
        types[param["name"]] = param["type"] or "Any"
    try:
        signature = inspect.Signature(params)
    except ValueError:  # e.g. a default before a required parameter
        return None
    return Prototype(name, signature, types, returns.strip())


def _split_params(text: str) -> list[str]:
    """Split on commas outside brackets (defaults such as `int[2] stride=[1,1]`)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += char in "[("
        depth -= char in "])"
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        items.append(current.strip())
    return items


def documented_ops(root: Path) -> dict[str, list[Prototype]]:
    """Every documented op's prototypes (some ops have overloads), by name."""
    ops: dict[str, list[Prototype]] = {}
    text = (root / "torch_npu" / "_op_plugin_docs.py").read_text(encoding="utf-8")
    for line in text.splitlines():
        proto = parse_prototype(line)
        if proto is not None:
            ops.setdefault(proto.name, []).append(proto)
    return ops


def op_description(root: Path, name: str) -> str:
    """The docs text block of op `name` (what the layout and sparse_mode checks read)."""
    text = (root / "torch_npu" / "_op_plugin_docs.py").read_text(encoding="utf-8")
    start = text.index(f'"{name}",')
    end = text.find("_add_torch_npu_docstr(", start)
    return text[start : end if end > 0 else len(text)]


def optimizer_signature(root: Path, module: str, class_name: str) -> inspect.Signature:
    """`class_name.__init__`'s signature (self dropped) read from torch_npu/optim/<module>.py."""
    tree = ast.parse((root / "torch_npu" / "optim" / f"{module}.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return _signature_of(item)
    raise LookupError(f"{class_name}.__init__ not found in torch_npu/optim/{module}.py")


def _signature_of(func: ast.FunctionDef) -> inspect.Signature:
    args = func.args.args[1:]  # drop self
    defaults = [ast.literal_eval(d) for d in func.args.defaults]
    first_default = len(args) - len(defaults)
    params = []
    for index, arg in enumerate(args):
        default = defaults[index - first_default] if index >= first_default else inspect._empty
        params.append(
            inspect.Parameter(arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        )
    return inspect.Signature(params)


@dataclass(frozen=True)
class Call:
    """One `torch_npu.<path>(...)` call in product code."""

    path: str
    file: str
    line: int
    positional: int
    keywords: tuple[str, ...]
    literals: dict[str, object]
    has_star_kwargs: bool


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "torch_npu":
        return ".".join(reversed(parts))
    return None


def product_calls() -> list[Call]:
    """Every call through the `torch_npu` module in kernels/, models/ and services/."""
    calls = []
    for top in PRODUCT_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                dotted = _dotted(node.func)
                if not dotted:
                    continue
                literals: dict[str, object] = {}
                for index, arg in enumerate(node.args):
                    if isinstance(arg, ast.Constant):
                        literals[f"#{index}"] = arg.value
                for kw in node.keywords:
                    if kw.arg is not None and isinstance(kw.value, ast.Constant):
                        literals[kw.arg] = kw.value.value
                calls.append(
                    Call(
                        path=dotted,
                        file=str(path.relative_to(REPO)),
                        line=node.lineno,
                        positional=len(node.args),
                        keywords=tuple(kw.arg for kw in node.keywords if kw.arg is not None),
                        literals=literals,
                        has_star_kwargs=any(kw.arg is None for kw in node.keywords),
                    )
                )
    return calls
