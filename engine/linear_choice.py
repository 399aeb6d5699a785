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

Each probe call takes the next of the model's own weights of that shape (up to PROBE_BYTES of
them), as a decode step does, instead of one weight again and again: one weight stays in the
CPU's cache, while a step streams every layer's weight from memory. Timed on one cached
weight, column-major read 3-10% slower than dense at one row on the hidden-1024 bench model
(e.g. 1,512 vs 1,420 us), around the 3% "no slower" line, so the choice flipped between dense and
packed+gemv from one start to the next (5 of 6 starts dense), and served batch 8 with it
between 1.08x and 1.5x HF. Streamed in a decode step, column-major is no slower at one row
(10.98 vs 11.38 ms a step). Streamed, best of 5 rounds, 14 starts in a row chose
packed+gemv.

"packed+gemv" (oneDNN-packed weights, with the dense ones kept for one-row calls) needs no
probe of its own: its one-row calls are dense calls and its other calls packed ones. It keeps
a second copy of every linear weight, so auto considers it only when that copy takes at most
GEMV_COPY_MEMORY_SHARE of the memory available at start-up (the smaller of the system's and
the cgroup's). Where the engine runs steps of up to `c_rows` rows in C over row-major weights
(engine/native_step.py), only larger steps run the layout, and only "dense" and "packed+gemv"
keep row-major weights: auto then times those two (dense and packed calls) at 4 x `c_rows`
rows only and picks between them.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.packed_linear import PackedLinear, can_pack

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 8)
"""Rows per decode step probed: batch-1 and a small batch."""
ROUNDS = 5
"""Alternated rounds, the best of each kept: with 3 the one-row comparison still flipped."""
CALLS = 8
CALL_ELEMENTS = 1 << 24
"""Calls per round shrink for big weights so that the probe stays well under a second."""
PROBE_BYTES = 64 << 20
"""Per shape, the probe cycles through the model's weights of that shape up to this many bytes
(at least one): more than a CPU cache holds, so the weights stream as in a decode step. The
packed and column-major copies of those weights live only while the probe runs."""
MARGIN = 0.9
"""Another layout is chosen only when it takes under this fraction of the dense time."""
SAME = 1.03
"""A layout counts as no slower than dense at a row count within this factor (probe noise)."""
NOISY = 1.5
"""A probe whose rounds of one layout vary more than this (median round over best round) ran
on a busy machine: its comparison is not trusted and auto keeps dense (logged), rather than
keep for the whole run a layout that won by another process's timing."""
LAYOUTS = ("dense", "packed", "colmajor")
"""What "auto" times (dense first: the layout kept without a clear win)."""
GEMV_COPY = "packed+gemv"
GEMV_COPY_MEMORY_SHARE = 0.1
"""auto may keep a second copy of the linear weights (packed+gemv) when it takes at most this
share of the available memory."""


def choose_cpu_linear(
    model: nn.Module,
    skip: tuple[str, ...] = (),
    available_bytes: int | None = None,
    c_rows: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> str:
    """The fastest of "dense", "packed", "colmajor" (and "packed+gemv" when its extra copy fits
    in GEMV_COPY_MEMORY_SHARE of `available_bytes`, default: `available_memory()`) for `model`'s
    linear shapes here; a layout other than dense only when it takes under MARGIN of the dense
    time (modules named in `skip` stay dense either way and are not timed).

    `c_rows`: steps of up to this many rows run in C over row-major weights
    (engine.native_step), so only "dense" and "packed+gemv" qualify, judged at 4 x `c_rows`
    rows, a step the layout runs.

    Where the probe's rounds vary by more than NOISY (a busy machine), the choice is "dense"
    whatever the times say, logged with the spread. `clock`: the timer (tests inject one)."""
    shapes = _linears_by_shape(model, skip)
    if not shapes:
        return "dense"
    copy_bytes = sum(
        module.weight.numel() * module.weight.element_size()
        for name, module in model.named_modules()
        if name not in skip and can_pack(module)
    )
    available = available_memory() if available_bytes is None else available_bytes
    allow_copy = available is not None and copy_bytes <= GEMV_COPY_MEMORY_SHARE * available
    probed = (4 * c_rows,) if c_rows else PROBE_ROWS
    timed = ("dense", "packed") if c_rows else LAYOUTS  # column-major is no candidate then
    times = {(layout, rows): 0.0 for layout in timed for rows in probed}
    spread = 1.0
    with torch.inference_mode():
        for same_shape in shapes:
            first = same_shape[0]
            copies = [
                (
                    linear,
                    PackedLinear(linear),
                    column_major_copy(linear.weight.detach()) if "colmajor" in timed else None,
                )
                for linear in same_shape
            ]
            for rows in probed:
                x = torch.randn(rows, 1, first.in_features, dtype=first.weight.dtype)
                calls = max(len(copies), min(CALLS, CALL_ELEMENTS // first.weight.numel()))
                layers = _layouts(copies, x, timed)
                best, rounds_spread = _time_alternated(layers, calls, clock)
                spread = max(spread, rounds_spread)
                for layout, seconds in zip(timed, best, strict=True):
                    times[layout, rows] += seconds
            del copies
    choice = pick_layout(times, allow_copy=allow_copy, row_major=c_rows > 0)
    if spread > NOISY:
        log.warning(
            "--cpu-linear auto: the probe's rounds varied %.1fx (over %.1fx: a busy machine); "
            "keeping dense instead of %s for this run (pass --cpu-linear to choose)",
            spread,
            NOISY,
            choice,
        )
        return "dense"
    log.info(
        "--cpu-linear auto: %s us per probe (rounds within %.2fx) -> %s%s",
        "; ".join(
            f"{layout} " + "/".join(f"{times[layout, rows] * 1e6:.1f}" for rows in probed)
            for layout in timed
        ),
        spread,
        choice,
        f" (+{copy_bytes / 2**20:.0f} MiB: the packed weights beside the dense ones, which "
        "one-row calls and the C decode step read; --cpu-linear packed or colmajor keeps one "
        "copy)"
        if choice == GEMV_COPY
        else "",
    )
    return choice


def pick_layout(
    times: dict[tuple[str, int], float], allow_copy: bool = False, row_major: bool = False
) -> str:
    """The layout to keep from probe times per (layout, rows): another layout than dense only
    when it is no slower than dense at any probed row count (within SAME) and takes under
    MARGIN of the dense time over all of them, so a gain at batch 8 never costs batch 1.
    `allow_copy` adds "packed+gemv", timed as dense at one row and packed above.
    `row_major` (the C decode step reads row-major weights, which neither "packed" nor
    "colmajor" keeps): "packed+gemv" is the only candidate, judged at the probed row counts."""
    times = dict(times)
    rows_probed = sorted({rows for _, rows in times})
    candidates = [] if row_major else list(LAYOUTS[1:])
    if allow_copy:
        for rows in rows_probed:
            times[GEMV_COPY, rows] = times["dense" if rows == 1 else "packed", rows]
        candidates.append(GEMV_COPY)
    dense = sum(times["dense", rows] for rows in rows_probed)
    eligible = [
        layout
        for layout in candidates
        if all(times[layout, rows] <= SAME * times["dense", rows] for rows in rows_probed)
    ]
    total = {layout: sum(times[layout, rows] for rows in rows_probed) for layout in eligible}
    best = min(eligible, key=total.__getitem__, default="dense")
    return best if best != "dense" and total[best] < MARGIN * dense else "dense"


def available_memory() -> int | None:
    """Bytes this process may still allocate: the system's MemAvailable, capped by the cgroup
    limit less its usage (a container's); None where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                raw = limit.read().strip()
                if raw != "max" and int(raw) < 1 << 60:  # cgroup v1 "no limit" is a huge number
                    found.append(max(0, int(raw) - int(usage.read().strip())))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


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


def _linears_by_shape(model: nn.Module, skip: tuple[str, ...]) -> list[list[nn.Linear]]:
    """The packable linears of `model` grouped by weight shape (the layers repeat theirs), each
    group cut to its first PROBE_BYTES of weights (at least one linear)."""
    by_shape: dict[tuple[int, int], list[nn.Linear]] = {}
    for name, module in model.named_modules():
        if name in skip or not can_pack(module):
            continue
        assert isinstance(module, nn.Linear)
        group = by_shape.setdefault((module.in_features, module.out_features), [])
        weight = module.weight
        if not group or (len(group) + 1) * weight.numel() * weight.element_size() <= PROBE_BYTES:
            group.append(module)
    return list(by_shape.values())


def _layouts(
    copies: list[tuple[nn.Linear, PackedLinear, torch.Tensor | None]],
    x: torch.Tensor,
    timed: tuple[str, ...] = LAYOUTS,
) -> tuple[Callable[[], object], ...]:
    """Per layout of `timed` (in that order), one call on `x` of the next linear of `copies`
    (cycling; the column-major copies are None unless "colmajor" is timed)."""
    turn = {layout: itertools.cycle(copies) for layout in timed}

    def dense() -> object:
        linear, _, _ = next(turn["dense"])
        return F.linear(x, linear.weight, linear.bias)

    def packed() -> object:
        _, packed_linear, _ = next(turn["packed"])
        return packed_linear(x)

    def colmajor() -> object:
        linear, _, column_major = next(turn["colmajor"])
        assert column_major is not None
        return F.linear(x, column_major, linear.bias)

    calls = {"dense": dense, "packed": packed, "colmajor": colmajor}
    return tuple(calls[layout] for layout in timed)


def _time_alternated(
    layers: tuple[Callable[[], object], ...],
    calls: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[float], float]:
    """Min over alternated rounds of the seconds per call of each layer, and the rounds' spread:
    the largest over layers of median round / best round (1.0: steady)."""
    rounds: list[list[float]] = [[] for _ in layers]
    for fn in layers:  # warm-up (oneDNN builds its primitive on the first call)
        fn()
    for _ in range(ROUNDS):
        for i, fn in enumerate(layers):
            start = clock()
            for _ in range(calls):
                fn()
            rounds[i].append(max(clock() - start, 1e-12) / calls)
    best = [min(r) for r in rounds]
    spread = max(statistics.median(r) / b for r, b in zip(rounds, best, strict=True))
    return best, spread
