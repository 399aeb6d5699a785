"""The torch versions Meshline supports, checked once when `kernels` is imported.

The floor is the oldest torch that Ascend's torch_npu and current GPU images ship with the APIs
Meshline builds on (FSDP2 `fully_shard`, DTensor, `torch.distributed.pipelining` with the
zero-bubble and DualPipeV schedules, `nn.Module.compile`); the ceiling is the newest release the
suite has run on (the pin in the Makefile). Older torch is refused with the fix; newer torch
runs with a warning, since nothing in it is known to break but nothing has been tested either.
"""

from __future__ import annotations

import re
import warnings

import torch

MIN_TORCH = (2, 11)
"""Oldest supported torch (torch_npu 2.11 and CUDA 13 images)."""
TESTED_MAX = (2, 13)
"""Newest torch the suite runs on (TORCH_SPEC in the Makefile)."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.13.0+cpu" or "2.11.0a0+git1234"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"unrecognised torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str = torch.__version__) -> None:
    """RuntimeError for a torch older than MIN_TORCH; a warning for one newer than TESTED_MAX."""
    found = parse_version(version)
    floor = ".".join(map(str, MIN_TORCH))
    if found < MIN_TORCH:
        raise RuntimeError(
            f"Meshline needs torch >= {floor}, found {version}; install a newer torch "
            f"(`make setup` pins torch=={'.'.join(map(str, TESTED_MAX))}.0 on CPU; GPU/NPU "
            f"machines: the torch {floor}+ build their driver or torch_npu needs)"
        )
    if found > TESTED_MAX:
        warnings.warn(
            f"torch {version} is newer than the newest version Meshline is tested on "
            f"({'.'.join(map(str, TESTED_MAX))}); report problems with the version",
            stacklevel=2,
        )
