"""Where a conversion may write, and how its output replaces an old one.

`save_dir` is untrusted: a request that names the data root, the source checkpoint, a directory
above or inside the source, or somebody else's directory must not lose data. So:

- `save_dir` may not be, contain or lie inside any directory the conversion reads;
- an existing non-empty `save_dir` is replaced only with `overwrite` and only when it holds the
  `MARKER` manifest this module writes into every output (so only the converter's own outputs
  are ever replaced), and never when it is a symlink;
- the new output is written to a staging directory beside `save_dir` and swapped in with one
  atomic `renameat2(RENAME_EXCHANGE)` where the kernel has it (two renames otherwise); the old
  output is deleted only after the new one is in place;
- the staging folder is made, published and removed through its parent opened beneath the data
  root (`checkpoints.safe_fs`), records its owner, and one a killed conversion left is removed
  when the service starts (`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoints.safe_fs import Dir, open_dir_beneath
from services.common.stale_staging import OWNER_FILE, sweep, write_owner

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


def check_replaceable(save_dir: Path, overwrite: bool, shown: Path | None = None) -> None:
    """Raise FileExistsError unless `save_dir` is absent, an empty directory, or (with
    `overwrite`) a directory the converter wrote; a symlink is never replaced. Messages name
    `shown` (default `save_dir`)."""
    real, save_dir = save_dir, shown or save_dir
    if real.is_symlink():
        raise FileExistsError(
            f"--save-dir {save_dir} is a symlink; give the real directory or a new path"
        )
    if not real.exists():
        return
    if not real.is_dir():
        raise FileExistsError(f"--save-dir {save_dir} exists and is not a directory")
    if not any(real.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"--save-dir {save_dir} exists and is not empty; pass --overwrite or choose another"
        )
    if not written_by_converter(real):
        raise FileExistsError(
            f"--save-dir {save_dir} exists and was not written by the converter (no {MARKER}); "
            "--overwrite only replaces an earlier conversion's output: choose a new directory"
        )


STAGING_NAME = re.compile(r"\..+\.(converting|replaced)-[0-9a-f]{8}")
"""The converter's own staging names (a killed conversion's are removed at service start)."""


@dataclass
class Staging:
    """A conversion's hidden staging folder beside `save_dir`, with its parent opened."""

    parent: Dir
    """`save_dir`'s parent, opened beneath its data root when the conversion started."""
    name: str
    """The staging folder's name in `parent`."""
    owner_lock: int = -1
    """The descriptor holding the owner file's lock while the conversion runs."""

    def unlock(self) -> None:
        """Drops the owner lock (the conversion has ended)."""
        if self.owner_lock >= 0:
            os.close(self.owner_lock)
            self.owner_lock = -1

    @property
    def path(self) -> Path:
        """The staging folder (where the sink writes)."""
        return self.parent.path / self.name


def staging_dir(save_dir: Path, roots: Sequence[Path] = ()) -> Staging:
    """A new, empty, hidden folder beside `save_dir` to write the output into, owned by us.

    The parent is opened beneath its data root (`roots`, else `/` after resolving it now) and
    kept open: publishing and clean-up go through it, never through the path again.
    """
    parent = open_dir_beneath(save_dir.parent, roots, create=True)
    try:
        name = f".{save_dir.name}.converting-{uuid.uuid4().hex[:8]}"
        os.mkdir(name, 0o700, dir_fd=parent.fd)
        with parent.subdir(name) as stage:
            owner_lock = write_owner(stage)
    except BaseException:
        parent.close()
        raise
    return Staging(parent, name, owner_lock)


def discard(staging: Staging) -> None:
    """Removes the staging folder (a failed or cancelled conversion) and closes its parent."""
    with staging.parent, contextlib.suppress(FileNotFoundError):
        try:
            staging.parent.rmtree(staging.name)
        finally:
            staging.unlock()


def sweep_stale(roots: Sequence[Path]) -> list[Path]:
    """Removes staging folders that killed conversions left under `roots` (service start)."""
    return sweep(roots, STAGING_NAME, set, "conversion")


MAX_SOURCE_FILES = 100_000
"""Files of a source folder fingerprinted at most (a larger one is refused, naming the flag)."""


def source_fingerprint(directory: Path, flag: str) -> dict[str, Any]:
    """What the output was converted from: sha256 over (relative path, size, mtime) of every
    file under `directory` (links not followed), with the counts.

    Recorded in the output's `MARKER`, so an output can be matched to the exact source state it
    came from (a source rewritten since gives another fingerprint).
    """
    entries: list[list[Any]] = []
    for current, dirs, files in os.walk(directory, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            path = Path(current) / name
            info = os.lstat(path)
            entries.append([str(path.relative_to(directory)), info.st_size, info.st_mtime_ns])
            if len(entries) > MAX_SOURCE_FILES:
                raise UnsafeSaveDir(
                    f"{flag} {directory}: more than {MAX_SOURCE_FILES} files; point it at one "
                    "checkpoint folder"
                )
    text = json.dumps(entries, separators=(",", ":"))
    return {
        "path": str(directory),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "files": len(entries),
        "bytes": sum(entry[1] for entry in entries),
    }


def write_marker(directory: Path, details: dict[str, Any]) -> None:
    """Record in `directory` that the converter wrote it (what from, which files)."""
    (directory / MARKER).write_text(json.dumps({"written_by": WRITER, **details}, indent=2))


_RENAME_EXCHANGE = 2


def _exchange(parent: Dir, a: str, b: str) -> bool:
    """Atomically swap entries `a` and `b` of `parent` (Linux renameat2); False where it cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    result = renameat2(
        parent.fd, os.fsencode(a), parent.fd, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE)
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, f"swapping {a} and {b} in {parent.path}: {os.strerror(code)}")


def publish(staging: Staging, save_dir: Path, overwrite: bool) -> None:
    """Move the finished staging folder to `save_dir`, swapping out an earlier output if any.

    `save_dir` is checked again here (it may have changed while the conversion ran), and every
    rename and delete is relative to the parent opened at staging: a parent swapped for a
    symlink meanwhile sends nothing elsewhere and deletes nothing outside.
    """
    parent, name, final = staging.parent, staging.name, save_dir.name
    with parent, contextlib.ExitStack() as ended:
        ended.callback(staging.unlock)
        info = parent.lstat(final)
        if info is not None and stat.S_ISLNK(info.st_mode):
            raise FileExistsError(
                f"--save-dir {save_dir} is a symlink; give the real directory or a new path"
            )
        check_replaceable(Path(parent.proc_path()) / final, overwrite, shown=save_dir)
        with parent.subdir(name) as stage:
            stage.unlink(OWNER_FILE)
        if info is None:
            os.rename(name, final, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
            return
        if _exchange(parent, name, final):
            parent.rmtree(name)  # now the old output
            return
        old = f".{final}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, old, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
        os.rename(name, final, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
        parent.rmtree(old)
