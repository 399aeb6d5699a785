"""Where a conversion may write, and how its output replaces an old one.

`save_dir` is untrusted: a request that names the data root, the source checkpoint, a directory
above or inside the source, or somebody else's directory must not lose data. So:

- `save_dir` may not be, contain or lie inside any directory the conversion reads;
- an existing non-empty `save_dir` is replaced only with `overwrite` and only when it holds the
  `MARKER` manifest this module writes into every output (so only the converter's own outputs
  are ever replaced), and never when it is a symlink;
- the new output is written to a staging directory beside `save_dir` and swapped in with one
  atomic `renameat2(RENAME_EXCHANGE)` where the kernel has it (two renames otherwise); the old
  output is deleted only after the new one is in place.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKER = ".meshline-convert.json"
"""Manifest in every converter output; its presence is what lets `overwrite` replace it."""
WRITER = "meshline-converter"


class UnsafeSaveDir(ValueError):
    """`save_dir` would overwrite or delete data the conversion does not own."""


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_save_dir(save_dir: Path, reads: Sequence[tuple[str, Path]]) -> None:
    """Raise UnsafeSaveDir when `save_dir` is a filesystem root or is, contains or lies inside
    one of `reads` ((flag, directory) pairs the conversion reads)."""
    save = _real(save_dir)
    if save == Path(save.anchor):
        raise UnsafeSaveDir(f"--save-dir {save_dir} is the filesystem root; choose a new directory")
    for flag, directory in reads:
        source = _real(directory)
        if save == source or save in source.parents or source in save.parents:
            relation = (
                "is" if save == source else "contains" if save in source.parents else "lies inside"
            )
            raise UnsafeSaveDir(
                f"--save-dir {save_dir} {relation} {flag} {directory}; writing there would "
                "replace or mix with the checkpoint being read; choose a separate directory"
            )


def written_by_converter(directory: Path) -> bool:
    """Whether `directory` holds this module's manifest as a regular file."""
    try:
        mode = os.lstat(directory / MARKER).st_mode
    except OSError:
        return False
    if not stat.S_ISREG(mode):
        return False
    try:
        return json.loads((directory / MARKER).read_text()).get("written_by") == WRITER
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(save_dir: Path, overwrite: bool) -> None:
    """Raise FileExistsError unless `save_dir` is absent, an empty directory, or (with
    `overwrite`) a directory the converter wrote; a symlink is never replaced."""
    if save_dir.is_symlink():
        raise FileExistsError(
            f"--save-dir {save_dir} is a symlink; give the real directory or a new path"
        )
    if not save_dir.exists():
        return
    if not save_dir.is_dir():
        raise FileExistsError(f"--save-dir {save_dir} exists and is not a directory")
    if not any(save_dir.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"--save-dir {save_dir} exists and is not empty; pass --overwrite or choose another"
        )
    if not written_by_converter(save_dir):
        raise FileExistsError(
            f"--save-dir {save_dir} exists and was not written by the converter (no {MARKER}); "
            "--overwrite only replaces an earlier conversion's output: choose a new directory"
        )


def staging_dir(save_dir: Path) -> Path:
    """A new, empty, hidden directory beside `save_dir` to write the output into."""
    save_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = save_dir.with_name(f".{save_dir.name}.partial-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    return tmp


def write_marker(directory: Path, details: dict[str, Any]) -> None:
    """Record in `directory` that the converter wrote it (what from, which files)."""
    (directory / MARKER).write_text(json.dumps({"written_by": WRITER, **details}, indent=2))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap `a` and `b` (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    result = renameat2(
        _AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE)
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, f"swapping {a} and {b}: {os.strerror(code)}")


def publish(tmp: Path, save_dir: Path, overwrite: bool) -> None:
    """Move the finished `tmp` to `save_dir`, swapping out an earlier output if there is one.

    `save_dir` is checked again here (it may have changed while the conversion ran)."""
    check_replaceable(save_dir, overwrite)
    if not save_dir.exists():
        os.rename(tmp, save_dir)
        return
    if _exchange(tmp, save_dir):
        shutil.rmtree(tmp)  # now the old output
        return
    old = save_dir.with_name(f".{save_dir.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(save_dir, old)
    os.rename(tmp, save_dir)
    shutil.rmtree(old)
