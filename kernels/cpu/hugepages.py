"""Serve CPU weights from transparent huge pages (Linux): decode streams them faster.

A decode step reads every weight once, so at sizes past the caches its time is the weights'
bytes over the memory bandwidth (bench/RESULTS.md, the roofline). Anonymous memory comes in
4 KiB pages unless a range is advised otherwise, and most distributions set transparent huge
pages to `madvise`: the weights then sit in 4 KiB pages, and a stream over them misses the TLB
every 4 KiB. Measured on the project's 2-core AMD EPYC: a 196 MiB read ran ~10% faster from
2 MiB pages (34.5 against 31.4 GB/s, 12 alternated rounds), and served decode of the hidden-1024
bench model at batch 1 took 6.61 against 7.34 ms per token (decision record "CPU weights in
transparent huge pages").

`move_to_huge_pages(model)` copies the model's large parameters and buffers into one private
anonymous mapping advised with MADV_HUGEPAGE and points the parameters at it (`param.data`), so
modules, tied weights and optimizers keep the same Parameter objects. Call it right after
loading, before anything takes views of the weights: a view taken earlier keeps reading the old
memory. A later call moves only what was replaced since (the engine calls it again after
`--cpu-linear colmajor` has rewritten the weights); what it moved before shares one storage and
stays. Where the kernel has THP off (`never`), on other systems, or where nothing is large
enough, it changes nothing and says why.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 * 2**20
"""x86-64's transparent huge page size."""
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class Moved:
    """What `move_to_huge_pages` did."""

    tensors: int
    """Parameters and buffers now in the advised mapping."""
    nbytes: int
    """Their bytes."""
    why: str
    """One line for the log: where they are, or why nothing moved."""


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "" where the
    system does not say (not Linux, or no THP support)."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of zeroed uint8 CPU memory starting on a 2 MiB boundary of a private anonymous
    mapping advised for huge pages, or None where that cannot be had (see `thp_mode`). The
    tensor keeps the mapping alive (torch.frombuffer holds a reference to it)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not sys.platform.startswith("linux") or advice is None or thp_mode() in ("", "never"):
        return None
    # MAP_SHARED anonymous memory is shmem, which follows a separate THP setting (usually
    # never): the mapping must be private.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:
        region.close()
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _movable(tensor: torch.Tensor, min_bytes: int) -> bool:
    """A plain dense CPU tensor (no subclass such as DTensor), row-major or a column-major
    matrix, alone in its storage (nothing else can view part of it)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter):
        return False
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_mkldnn:
        return False
    nbytes = tensor.numel() * tensor.element_size()
    dense = tensor.is_contiguous() or (tensor.dim() == 2 and tensor.t().is_contiguous())
    return (
        nbytes >= min_bytes
        and dense
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes
    )


def move_to_huge_pages(model: nn.Module, min_bytes: int = HUGE_PAGE) -> Moved:
    """Copy `model`'s parameters and buffers of at least `min_bytes` into one huge-page mapping
    (see the module docstring); values, dtypes, shapes and Parameter objects are unchanged."""
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or not _movable(tensor, min_bytes):
            continue
        seen.add(id(tensor))
        tensors.append(tensor)
    if not tensors:
        return Moved(0, 0, f"no CPU weight of {min_bytes // 2**20} MiB or more to move")
    # Each tensor starts on a cache line; they are packed back to back in the mapping.
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    buffer = huge_page_buffer(sum(sizes))
    if buffer is None:
        mode = thp_mode() or "not available on this system"
        return Moved(0, 0, f"weights stay in 4 KiB pages (transparent huge pages: {mode})")
    offset = 0
    with torch.no_grad():
        for tensor, size in zip(tensors, sizes, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            flat = buffer[offset : offset + nbytes].view(tensor.dtype)
            target = flat.as_strided(tensor.shape, tensor.stride())  # keeps a column-major layout
            target.copy_(tensor)
            tensor.data = target
            offset += size
    moved = sum(t.numel() * t.element_size() for t in tensors)
    return Moved(
        len(tensors),
        moved,
        f"{len(tensors)} weights ({moved / 2**20:.0f} MiB) in transparent huge pages "
        f"(THP {thp_mode()})",
    )
