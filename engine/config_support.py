"""Which `ModelConfig` fields a fast decode path implements, as data.

Each fast path (the lean step, `engine/decode_step.py`; the C step, `engine/native_step.py`; CUDA
graphs, `engine/cuda_graphs.py`) holds a table with one row per `ModelConfig` field: the values
it computes exactly as the module forward does, and why it declines the others. The path checks
its table before it reads the model, so a configuration it does not implement is declined by
name (the engine then keeps the module forward and logs the reason) and never silently computed
another way. `tests/engine/test_decode_support.py` fails when a field has no row, and runs every
row: each declined value is refused, each implemented one decodes as the module forward does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.config import ModelConfig


@dataclass(frozen=True)
class FieldSupport:
    """One table row: which values of a ModelConfig field a decode path computes."""

    implemented: Callable[[Any], bool]
    """True for a value the path computes as the module forward does."""
    why: str
    """What the path does with the field (implemented) or why it declines other values."""


def every(why: str) -> FieldSupport:
    """Every value is implemented (a size the path reads, or a training-only setting)."""
    return FieldSupport(lambda value: True, why)


def only(*values: Any, why: str) -> FieldSupport:
    """Only `values` are implemented; any other value is declined."""
    return FieldSupport(lambda value: value in values, why)


def declined(config: ModelConfig, table: dict[str, FieldSupport]) -> str | None:
    """The first field of `config` whose value the path's `table` declines, as a reason; None
    when every field is implemented. A field without a row is declined (a new field must be
    classified before a fast path runs it)."""
    for field in dataclasses.fields(ModelConfig):
        value = getattr(config, field.name)
        row = table.get(field.name)
        if row is None:
            return f"ModelConfig.{field.name} is not classified for this decode path"
        if not row.implemented(value):
            return f"ModelConfig.{field.name}={value!r}: {row.why}"
    return None
