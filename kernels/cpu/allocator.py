"""Keep a CPU training process's freed memory for its next step (glibc malloc settings).

A training step allocates and frees the same activations and gradients every step. By default
glibc serves blocks above a dynamic threshold with fresh mmaps and gives the top of the heap back
to the OS when a large part of it is free, so on the CPU every step touched new pages: measured
~19,000 page faults a step for `meshline train` at hidden 1024 (~36,000 for the HF loop), each
zeroing a 4 KiB page inside the step, and a fresh 23 MiB gradient buffer cost 6.5 ms to allocate
against 2 ms for the kernel that fills it (bench/RESULTS.md, "Fused CPU training kernels").
With blocks up to 32 MiB (glibc's largest threshold) taken from the heap and the heap never
trimmed, warm steps reuse their pages (measured: 0 faults a step at hidden 256 and 1024, from
~5,000 and ~19,000). The process keeps its peak heap, which the next step needs anyway. Intel's PyTorch CPU launcher gets the same effect
by preloading jemalloc or tcmalloc.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's upper bound for M_MMAP_THRESHOLD on 64-bit hosts; larger blocks are always mmapped."""
NEVER_TRIM = 2**31 - 1
"""mallopt takes an int: the largest trim threshold it accepts (2 GiB)."""


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds as above; False where the C library is not glibc
    (musl, macOS) or refuses the settings, in which case nothing changed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    )
