"""`--cpu-linear auto`: pick dense or oneDNN-packed linear weights by timing both at start-up.

Which is faster depends on the CPU, the thread count and the shapes: on some machines oneDNN's
packed weights run decode-sized matmuls 1.3-1.8x faster than MKL's, on others a batch-1 call
is slower packed (~27 vs 8-24 us per call measured on a 2-core x86-64 box). So the engine
times the model's own linear shapes (each distinct one, at the decode row counts 1 and 8),
dense and packed alternated, and keeps packing only when it is clearly faster (10% margin).
Both layouts give the same tokens (tested), so the probe can only change speed.
"""

from __future__ import annotations

import logging
import time

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
"""Packed is chosen only when it takes under this fraction of the dense time."""


def choose_cpu_linear(model: nn.Module, skip: tuple[str, ...] = ()) -> str:
    """ "packed" when packed weights beat dense ones for `model`'s linear shapes here, else
    "dense" (modules named in `skip` stay dense either way and are not timed)."""
    shapes = _linears_by_shape(model, skip)
    if not shapes:
        return "dense"
    dense_s = packed_s = 0.0
    with torch.inference_mode():
        for linear in shapes:
            packed = PackedLinear(linear)
            for rows in PROBE_ROWS:
                x = torch.randn(rows, 1, linear.in_features, dtype=linear.weight.dtype)
                calls = max(1, min(CALLS, CALL_ELEMENTS // linear.weight.numel()))
                d, p = _time_pair(linear, packed, x, calls)
                dense_s += d
                packed_s += p
    choice = "packed" if packed_s < MARGIN * dense_s else "dense"
    log.info(
        "--cpu-linear auto: dense %.1f us, packed %.1f us per probe -> %s",
        dense_s * 1e6,
        packed_s * 1e6,
        choice,
    )
    return choice


def _linears_by_shape(model: nn.Module, skip: tuple[str, ...]) -> list[nn.Linear]:
    """One packable linear of `model` per weight shape (the layers repeat theirs)."""
    by_shape: dict[tuple[int, int], nn.Linear] = {}
    for name, module in model.named_modules():
        if name in skip or not can_pack(module):
            continue
        assert isinstance(module, nn.Linear)
        by_shape.setdefault((module.in_features, module.out_features), module)
    return list(by_shape.values())


def _time_pair(
    dense: nn.Linear, packed: PackedLinear, x: torch.Tensor, calls: int
) -> tuple[float, float]:
    """Min over alternated rounds of the seconds per call of the dense and the packed layer."""
    best = [float("inf"), float("inf")]
    layers = (lambda: F.linear(x, dense.weight, dense.bias), lambda: packed(x))
    for fn in layers:  # warm-up (oneDNN builds its primitive on the first call)
        fn()
    for _ in range(ROUNDS):
        for i, fn in enumerate(layers):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return best[0], best[1]
