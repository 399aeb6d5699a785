"""Peak FLOP/s of one device, the denominator of MFU.

Accelerators are looked up by model name in a table of dense (no structured sparsity) 16-bit
tensor-core peaks, the figure torchtitan's `get_peak_flops` and most published MFU numbers
divide by whatever precision the run uses. A CPU has no such figure: its peak is measured once
per process by short fp32 matmuls on the threads torch uses (the best of several spaced
repeats, so that a busy machine reads less low; a busy one is logged). `--peak-tflops`
overrides both.
"""

from __future__ import annotations

import functools
import logging
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeakFlops:
    """A device's peak TFLOP/s and where the figure came from (printed with the first step)."""

    tflops: float
    source: str


# (pattern matched against the device name, label, dense bf16/fp16 TFLOP/s). First match wins,
# so more specific names come first ("H100 PCIe" before "H100", "H200" before "H20").
ACCELERATOR_PEAKS: tuple[tuple[str, str, float], ...] = (
    (r"\bB200\b", "NVIDIA B200", 2250.0),
    (r"\bH200\b", "NVIDIA H200", 989.0),
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", 756.0),
    (r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", 835.0),
    (r"\bH100\b", "NVIDIA H100 SXM", 989.0),
    (r"\bH800\b", "NVIDIA H800", 989.0),
    (r"\bH20\b", "NVIDIA H20", 148.0),
    (r"\bA100\b", "NVIDIA A100", 312.0),
    (r"\bA800\b", "NVIDIA A800", 312.0),
    (r"\bL40S\b", "NVIDIA L40S", 362.0),
    (r"\bL40\b", "NVIDIA L40", 181.0),
    (r"\bL4\b", "NVIDIA L4", 121.0),
    (r"\bA10\b", "NVIDIA A10", 125.0),
    (r"\bV100\b", "NVIDIA V100", 125.0),
    (r"910B1", "Ascend 910B1", 414.0),
    (r"910B2", "Ascend 910B2", 376.0),
    (r"910B3", "Ascend 910B3", 313.0),
    (r"910B4", "Ascend 910B4", 280.0),
    (r"910B", "Ascend 910B", 313.0),
    (r"910", "Ascend 910", 256.0),
)
# Unknown models of a known device type: torchtitan's fallback (A100) for CUDA, 910B for NPU.
FALLBACK_PEAKS = {"cuda": ("an A100", 312.0), "npu": ("a 910B", 313.0)}


def lookup(device_type: str, name: str) -> PeakFlops | None:
    """The table's peak for an accelerator called `name`, or None when no row matches."""
    if device_type == "cpu":
        return None
    for pattern, label, tflops in ACCELERATOR_PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return PeakFlops(tflops, f"{label} dense bf16/fp16 peak (table)")
    return None


REPEATS = 10
"""Timed matmuls of the CPU measurement, the best kept."""
SPACING_S = 0.01
"""Pause between them: on a machine shared with other work, repeats spread over ~0.1 s land in
different scheduler slices, so one of them likely runs with the cores to itself (back to back,
five repeats inside one busy slice read 16.8 GFLOP/s of a 2-core box's ~100)."""
NOISY = 1.5
"""Median repeat over best repeat above this: the machine was busy while measuring."""


@dataclass(frozen=True)
class CpuMeasurement:
    """The CPU matmul measurement: best throughput and how steady its repeats were."""

    tflops: float
    """Best repeat, in TFLOP/s."""
    spread: float
    """Median repeat time over best repeat time (1.0: steady; over NOISY: a busy machine)."""


def measure_cpu(
    size: int = 512,
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
    pause: Callable[[float], None] = time.sleep,
) -> CpuMeasurement:
    """Best fp32 matmul throughput of this process's torch threads over `repeats` spaced
    matmuls (~0.15 s), and their spread. `clock` and `pause`: injected by tests."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool and packing buffers
    seconds = []
    for i in range(repeats):
        if i:
            pause(SPACING_S)
        start = clock()
        torch.mm(a, b)
        seconds.append(max(clock() - start, 1e-9))
    best = min(seconds)
    return CpuMeasurement(2.0 * size**3 / best / 1e12, statistics.median(seconds) / best)


@functools.lru_cache(maxsize=1)
def _measured_cpu_peak() -> PeakFlops:
    threads = torch.get_num_threads()
    found = measure_cpu()
    source = f"measured: fp32 matmul on {threads} thread(s) of this CPU, best of {REPEATS}"
    if found.spread > NOISY:
        log.warning(
            "the CPU peak was measured on a busy machine (repeats varied %.1fx): MFU may read "
            "high; pass --peak-tflops for a fixed denominator",
            found.spread,
        )
        source += f" (busy machine: repeats varied {found.spread:.1f}x)"
    return PeakFlops(found.tflops, source)


def peak_tflops(override: float | None = None) -> PeakFlops:
    """This process's device peak: `override` (--peak-tflops), the table, or a CPU measurement.

    An accelerator missing from the table logs a warning and uses its family's fallback; pass
    --peak-tflops to make MFU exact for it.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {override}")
        return PeakFlops(override, "--peak-tflops")
    platform = device.current()
    if platform.type == "cpu":
        return _measured_cpu_peak()
    name = platform.device_name()
    found = lookup(platform.type, name)
    if found is not None:
        return found
    label, tflops = FALLBACK_PEAKS.get(platform.type, ("an A100", 312.0))
    log.warning(
        "no peak FLOP/s known for %s device %r; MFU uses %s (%.0f TFLOP/s): pass --peak-tflops",
        platform.type,
        name,
        label,
        tflops,
    )
    return PeakFlops(tflops, f"fallback for unknown {platform.type} device ({label})")
