"""Flat fp32 swap files on local disk for the NVMe tier of the offloaded optimizer.

One `SwapFile` holds one optimizer state (Adam's `exp_avg`, or `exp_avg_sq`) of every parameter
the optimizer steps, back to back in a file created in an already opened directory (the caller
opens `nvme_path` through `checkpoints.safe_fs`: inside the data roots, no symlink followed;
this library may not import `checkpoints`, so it takes the directory as a `SwapDirectory`). The step streams the file
through a few bounded host buffers with `os.preadv`/`os.pwrite` on a thread pool (both release
the GIL, so disk I/O overlaps the Adam arithmetic); `views` maps the file (`torch.from_file`,
shared) for checkpoints, so a save reads the states from the tier and a load writes them there
without holding a second copy in anonymous memory.

DeepSpeed's ZeRO-Infinity does the same with libaio and O_DIRECT; page-cache I/O is what Python
offers portably. The page cache is reclaimable memory, not the process's resident set: what the
process holds is the buffers (`buffer_count` x `buffer_numel` x 4 bytes per state).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Protocol

import torch

ELEMENT_BYTES = 4  # fp32
_serial = itertools.count()


class SwapDirectory(Protocol):
    """An opened directory (`checkpoints.safe_fs.Dir`): files are opened relative to it."""

    fd: int
    path: Path

    def open(self, relative: str, flags: int, mode: int = 0o644) -> int:
        """A descriptor for `relative` below the directory (no symlink followed)."""
        ...

    def close(self) -> None:
        """Close the directory's descriptor."""
        ...


class SwapFile:
    """`numel` fp32 values in a new, unlinked file in `folder`, zero-filled (sparse)."""

    def __init__(self, folder: SwapDirectory, name: str, numel: int) -> None:
        # A unique name per optimizer, so two runs (or two optimizers) never share a file.
        unique = f"{name}.{os.getpid()}.{next(_serial)}.swap"
        self.fd = folder.open(unique, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.path = Path(folder.path) / unique
        """Where the file was created (for messages; I/O goes through `fd`)."""
        # Unlinked at once: the descriptor keeps the blocks, nothing is left behind by a crash,
        # and no later operation goes by path.
        os.unlink(unique, dir_fd=folder.fd)
        os.ftruncate(self.fd, numel * ELEMENT_BYTES)
        self.numel = numel
        """Elements in the file."""

    def read(self, into: torch.Tensor, offset: int) -> None:
        """Fill contiguous fp32 `into` from element `offset` of the file."""
        view = memoryview(into.numpy()).cast("B")
        position, done = offset * ELEMENT_BYTES, 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], position + done)
            if got <= 0:
                raise OSError(f"short read from the NVMe swap file {self.path} at byte {position}")
            done += got

    def write(self, source: torch.Tensor, offset: int) -> None:
        """Store contiguous fp32 `source` at element `offset` of the file."""
        view = memoryview(source.detach().numpy()).cast("B")
        position, done = offset * ELEMENT_BYTES, 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], position + done)

    def mapping(self) -> torch.Tensor:
        """The whole file as a 1-D fp32 tensor over a shared mapping (pages load on touch)."""
        if self.numel == 0:
            return torch.empty(0)
        return torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=self.numel)

    def close(self) -> None:
        """Close the file; its blocks are freed (it was unlinked when created)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()
