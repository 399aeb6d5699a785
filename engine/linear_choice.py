"""`--cpu-linear auto`: pick dense, oneDNN-packed or column-major linear weights by timing them
at start-up.

Which is faster depends on the CPU, the thread count and the shapes: on some machines oneDNN's
packed weights run decode-sized matmuls 1.3-1.8x faster than MKL's, on others a batch-1 call
is slower packed (~27 vs 8-24 us per call measured on a 2-core x86-64 box). So the engine
times the model's own linear shapes (each distinct one, at the decode row counts 1 and 8),
the layouts alternated, and keeps another layout than dense only when it is clearly faster in
total (10% margin) and no slower at either row count (a batch-8 gain must not cost batch 1:
column-major weights measured 13% slower at one row for the hidden-1024 bench model).
Both layouts give the same tokens (tested), so the probe can only change speed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.packed_linear import PackedLinear, can_pack

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 8)
"""Rows per decode step probed: batch-1 and a small batch."""
ROUNDS = 3
CALLS = 8
CALL_ELEMENTS = 1 << 24
"""Calls per round shrink for big weights so that the probe stays well under a second."""
MARGIN = 0.9
"""Another layout is chosen only when it takes under this fraction of the dense time."""
SAME = 1.03
"""A layout counts as no slower than dense at a row count within this factor (probe noise)."""
LAYOUTS = ("dense", "packed", "colmajor")
"""What "auto" chooses from (dense first: the layout kept without a clear win)."""


def choose_cpu_linear(model: nn.Module, skip: tuple[str, ...] = ()) -> str:
    """The fastest of "dense", "packed" and "colmajor" for `model`'s linear shapes here; a
    layout other than dense only when it takes under MARGIN of the dense time (modules named in
    `skip` stay dense either way and are not timed)."""
    shapes = _linears_by_shape(model, skip)
    if not shapes:
        return "dense"
    times = {(layout, rows): 0.0 for layout in LAYOUTS for rows in PROBE_ROWS}
    with torch.inference_mode():
        for linear in shapes:
            packed = PackedLinear(linear)
            column_major = column_major_copy(linear.weight.detach())
            for rows in PROBE_ROWS:
                x = torch.randn(rows, 1, linear.in_features, dtype=linear.weight.dtype)
                calls = max(1, min(CALLS, CALL_ELEMENTS // linear.weight.numel()))
                layers = _layouts(linear, packed, column_major, x)
                for layout, seconds in zip(LAYOUTS, _time_alternated(layers, calls), strict=True):
                    times[layout, rows] += seconds
    choice = pick_layout(times)
    log.info(
        "--cpu-linear auto: %s us per probe -> %s",
        "; ".join(
            f"{layout} " + "/".join(f"{times[layout, rows] * 1e6:.1f}" for rows in PROBE_ROWS)
            for layout in LAYOUTS
        ),
        choice,
    )
    return choice


def pick_layout(times: dict[tuple[str, int], float]) -> str:
    """The layout to keep from probe times per (layout, rows): another layout than dense only
    when it is no slower than dense at any probed row count (within SAME) and takes under
    MARGIN of the dense time over all of them, so a gain at batch 8 never costs batch 1."""
    dense = sum(times["dense", rows] for rows in PROBE_ROWS)
    eligible = [
        layout
        for layout in LAYOUTS[1:]
        if all(times[layout, rows] <= SAME * times["dense", rows] for rows in PROBE_ROWS)
    ]
    total = {layout: sum(times[layout, rows] for rows in PROBE_ROWS) for layout in eligible}
    best = min(eligible, key=total.__getitem__, default="dense")
    return best if best != "dense" and total[best] < MARGIN * dense else "dense"


def column_major_copy(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [O, I] with column-major memory (same shape and values): MKL multiplies few-row
    inputs by it faster than by the row-major original (measured ~1.6x at 8 rows, the same at
    one row, on the 2-core x86-64 test box)."""
    return weight.t().contiguous().t()


def to_column_major(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Give every packable linear of `model` (not named in `skip`) column-major weights, in
    place (same parameters, same memory); returns how many."""
    count = 0
    for name, module in model.named_modules():
        if name in skip or not can_pack(module):
            continue
        assert isinstance(module, nn.Linear)
        module.weight.data = column_major_copy(module.weight.data)
        count += 1
    return count


def _linears_by_shape(model: nn.Module, skip: tuple[str, ...]) -> list[nn.Linear]:
    """One packable linear of `model` per weight shape (the layers repeat theirs)."""
    by_shape: dict[tuple[int, int], nn.Linear] = {}
    for name, module in model.named_modules():
        if name in skip or not can_pack(module):
            continue
        assert isinstance(module, nn.Linear)
        by_shape.setdefault((module.in_features, module.out_features), module)
    return list(by_shape.values())


def _layouts(
    linear: nn.Linear, packed: PackedLinear, column_major: torch.Tensor, x: torch.Tensor
) -> tuple[Callable[[], object], ...]:
    """One call of `linear` on `x` per layout, in LAYOUTS order."""
    return (
        lambda: F.linear(x, linear.weight, linear.bias),
        lambda: packed(x),
        lambda: F.linear(x, column_major, linear.bias),
    )


def _time_alternated(layers: tuple[Callable[[], object], ...], calls: int) -> list[float]:
    """Min over alternated rounds of the seconds per call of each layer."""
    best = [float("inf")] * len(layers)
    for fn in layers:  # warm-up (oneDNN builds its primitive on the first call)
        fn()
    for _ in range(ROUNDS):
        for i, fn in enumerate(layers):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return best
