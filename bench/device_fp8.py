"""`make device-check`'s FP8 phase: bf16 `--compile` against `--fp8 tensorwise|rowwise --compile`.

    python -m bench.device_check --phases fp8 --out DIR   (not among the default phases)

Each side runs in its own child process (`python -m bench.device_check --worker fp8:<side>`) on
the check's ~1.2B Llama shape (bench/device_workers.py `SHAPES`), through the trainer library
with the same flags as the check's `ours-compile` side plus `--fp8 <recipe>`:

1. throughput at the check's batch (global 16 x 2048 tokens, accumulation over micro-batches of
   2): tokens/s = global batch x sequence x timed steps / wall time after the warm-up steps,
   TFLOP/s = tokens/s x (6N + 12·L·H·Q·T) (models.accounting; FP8 does the same arithmetic, so
   it is counted at the same FLOPs), MFU against the device's bf16 dense peak;
2. the loss curve: a fresh run from the same seed (same initial weights, same mock batches) of
   200 steps at one micro-batch per step (2 x 2048 tokens, so 200 steps fit the lease),
   learning rate 1e-4 constant; `loss_200` = the mean loss of steps 191-200 (one step's loss
   is noisy; the mean of ten is what "the loss at step 200" is compared by).

The report's rows: `speedup` = FP8 tokens/s / bf16 `--compile` tokens/s (target >= 1.25),
`loss_gap` = |loss_200(FP8) - loss_200(bf16)| (target <= 0.01). In smoke mode (no GPU, or
--smoke) the same code runs eagerly on the tiny shape for 20 steps, which keeps the phase
working in CI; its figures say nothing about a GPU.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from kernels import device, peak_flops

SIDES = ("bf16-compile", "fp8-tensorwise", "fp8-rowwise")
TARGETS = {"speedup": 1.25, "loss_gap": 0.01}
"""The issue's figures: FP8 tokens/s over bf16 --compile's, and the loss gap at step 200."""
LOSS_STEPS = {"gpu": 200, "smoke": 20}
LOSS_WINDOW = 10
"""Steps averaged for `loss_200` (the last ten)."""


def side_flags(side: str, shape: dict[str, int], mode: str, *, loss_run: bool) -> list[str]:
    """The trainer flags of one side: the check's training flags, --compile on a GPU, --fp8."""
    from bench.device_workers import train_flags

    flags = train_flags(shape, bf16=True, compile_layers=mode == "gpu")
    if side.startswith("fp8-"):
        flags += ["--fp8", side.removeprefix("fp8-")]
    if loss_run:
        flags = _set(flags, "--global-batch-size", str(shape["mbs"]))
        flags = _set(flags, "--train-iters", str(LOSS_STEPS[mode]))
    return flags


def _set(flags: list[str], flag: str, value: str) -> list[str]:
    index = flags.index(flag)
    return [*flags[: index + 1], value, *flags[index + 2 :]]


def fp8_worker(side: str, mode: str) -> dict[str, Any]:
    """One side in this process: throughput at the check's batch, then the 200-step loss run."""
    import gc

    import torch
    from torch._dynamo.utils import counters

    from bench.device_workers import SHAPES

    # this phase's stack only: every device-check child imports this module
    from models.accounting import flops_per_token
    from services.trainer.arguments import parse_args
    from training.loop import Trainer
    from training.setup import build_model_config

    if side not in SIDES:
        raise ValueError(f"fp8 side {side!r}: use one of {SIDES}")
    shape = SHAPES[mode]
    torch.manual_seed(0)
    config = parse_args(side_flags(side, shape, mode, loss_run=False))
    trainer = Trainer(config)
    begin = time.perf_counter()
    for _ in range(shape["warmup"]):
        trainer.train_step()
    device.synchronize()
    warmup_s = time.perf_counter() - begin
    device.reset_peak_memory_stats()
    begin = time.perf_counter()
    for _ in range(shape["steps"]):
        trainer.train_step()
    device.synchronize()
    elapsed = time.perf_counter() - begin
    tokens_per_s = shape["gbs"] * shape["seq"] * shape["steps"] / elapsed
    tflops = tokens_per_s * flops_per_token(build_model_config(config), shape["seq"]) / 1e12
    result: dict[str, Any] = {
        "side": side,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak_flops.peak_tflops().tflops,
        "peak_memory_gib": device.memory_stats().peak / 2**30,
        "warmup_s": warmup_s,
    }
    del trainer
    gc.collect()
    torch.manual_seed(0)
    losses_run = Trainer(parse_args(side_flags(side, shape, mode, loss_run=True)))
    begin = time.perf_counter()
    losses = [losses_run.train_step().loss for _ in range(LOSS_STEPS[mode])]
    device.synchronize()
    result["loss_run_s"] = time.perf_counter() - begin
    result["losses_every_10"] = losses[9::10]
    result["loss_200"] = statistics.fmean(losses[-LOSS_WINDOW:])
    result["graph_breaks"] = sum(counters["graph_break"].values())
    return result


def run_fp8(mode: str, left: Callable[[float], float], child: Callable[..., dict[str, Any]],
            cap_s: float) -> dict[str, Any]:  # fmt: skip
    """Every side in its own child (each given up to 2 x `cap_s` of what the budget has left),
    then the comparison against bf16 --compile."""
    sides = {
        side: child(["--worker", f"fp8:{side}", "--mode", mode], left(2 * cap_s)) for side in SIDES
    }
    return {"sides": sides, "compare": compare(sides, mode)}


def compare(sides: dict[str, dict[str, Any]], mode: str) -> dict[str, Any]:
    """speedup and loss_gap of each FP8 side against bf16, with the targets; `meets_target` is
    reported only from a GPU run (None in smoke mode)."""
    base = sides.get("bf16-compile", {})
    rows: dict[str, Any] = {}
    for side, row in sides.items():
        if side == "bf16-compile" or "error" in row or "error" in base:
            continue
        speedup = row["tokens_per_s"] / base["tokens_per_s"]
        gap = abs(row["loss_200"] - base["loss_200"])
        met = speedup >= TARGETS["speedup"] and gap <= TARGETS["loss_gap"]
        rows[side] = {
            "speedup": speedup,
            "loss_gap": gap,
            "meets_target": met if mode == "gpu" else None,
        }
    return rows


def markdown_lines(fp8: dict[str, Any] | None) -> list[str]:
    """The FP8 phase as Markdown lines for report.md (none when the phase did not run)."""
    if not fp8:
        return []
    lines = [
        "",
        f"FP8 (targets: >= {TARGETS['speedup']}x bf16 --compile tokens/s, loss within "
        f"{TARGETS['loss_gap']} at step {LOSS_STEPS['gpu']}; loss = mean of the last "
        f"{LOSS_WINDOW} steps)",
        "",
        "| FP8 side | tokens/s | MFU | peak GiB | loss (last 10) | speedup | loss gap | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    compared = fp8.get("compare", {})
    for side, row in fp8.get("sides", {}).items():
        if "error" in row:
            lines.append(f"| {side} | {row['error']} | | | | | | |")
            continue
        versus = compared.get(side, {})
        speedup = versus.get("speedup", math.nan)
        gap = versus.get("loss_gap", math.nan)
        met = versus.get("meets_target")
        lines.append(
            f"| {side} | {row['tokens_per_s']:,.0f} | {row['mfu']:.1%} | "
            f"{row['peak_memory_gib']:.2f} | {row['loss_200']:.4f} | "
            f"{'' if side == 'bf16-compile' else f'{speedup:.2f}x'} | "
            f"{'' if side == 'bf16-compile' else f'{gap:.4f}'} | "
            f"{'' if met is None else ('yes' if met else 'no')} |"
        )
    return lines
