"""Peak FLOP/s of one device, the denominator of MFU.

Accelerators are looked up by model name in a table of dense (no structured sparsity) 16-bit
tensor-core peaks, the figure torchtitan's `get_peak_flops` and most published MFU numbers
divide by whatever precision the run uses. A CPU has no such figure: its peak is measured once
per process by a short fp32 matmul on the threads torch uses. `--peak-tflops` overrides both.
"""

from __future__ import annotations

import functools
import logging
import re
import time
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


def measure_cpu_tflops(size: int = 512, repeats: int = 5) -> float:
    """Best fp32 matmul throughput of this process's torch threads, in TFLOP/s (~50 ms)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool and packing buffers
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9) / 1e12


@functools.lru_cache(maxsize=1)
def _measured_cpu_peak() -> PeakFlops:
    threads = torch.get_num_threads()
    tflops = measure_cpu_tflops()
    return PeakFlops(tflops, f"measured: fp32 matmul on {threads} thread(s) of this CPU")


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
