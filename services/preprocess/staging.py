"""Hidden staging directories of preprocess jobs, and the cleanup of those a killed job left.

A job writes under `.{name}.partial-XXXX` next to its outputs and removes it when it ends. A job
that is killed (SIGKILL, OOM, a node lost) cannot, so each staging directory records its owner
(process id and start time) in an `.owner` file. A directory is stale when no live job of this
process owns it and its owner process is gone (or it has no owner file and is older than this
process). Stale directories are removed at service start (`sweep`) and when a job starts for the
same output (`remove_stale`); a running job's directory, here or in another process, is kept.

Every create, write, rename and delete goes through directories opened beneath the data root
(`services.common.safe_fs`): the output directory is opened once when the job stages, and the
job writes through `Stage.path` (`/proc/self/fd/N`, that very directory), so an output folder
swapped for a symlink afterwards redirects nothing and its clean-up deletes nothing outside.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from services.common.safe_fs import Dir, Escape, open_dir

logger = logging.getLogger(__name__)

OWNER_FILE = ".owner"
# The names `create` makes: the prefix, then 8 characters of [a-z0-9_] (as `tempfile.mkdtemp`).
_STAGE_NAME = re.compile(r"\..+\.partial-[a-z0-9_]{8}")
_PROCESS_STARTED = psutil.Process().create_time()
_live: set[tuple[int, int]] = set()
"""(device, inode) of the staging directories of this process's running jobs."""
_lock = threading.Lock()


def _owner_token() -> str:
    return f"{os.getpid()} {_PROCESS_STARTED!r}"


def _identity(directory: Dir) -> tuple[int, int]:
    info = os.fstat(directory.fd)
    return info.st_dev, info.st_ino


@dataclass
class Stage:
    """A job's staging directory, and the output directory it publishes into (both opened)."""

    output: Dir
    """The output directory, opened beneath its data root when the job staged."""
    name: str
    """The staging directory's name in `output`."""
    directory: Dir
    """The staging directory itself."""

    @property
    def path(self) -> Path:
        """A path naming the staging directory itself (writes through it cannot be redirected)."""
        return Path(self.directory.proc_path())

    def publish(self, name: str, final_name: str | None = None) -> None:
        """Moves the staged file `name` to `final_name` (default `name`) in the output directory."""
        os.rename(name, final_name or name, src_dir_fd=self.directory.fd, dst_dir_fd=self.output.fd)

    def remove_output(self, name: str) -> None:
        """Removes the file `name` from the output directory (a link itself, never its target)."""
        self.output.unlink(name)


def create(directory: Path, name: str, roots: Sequence[Path] = ()) -> Stage:
    """A new staging directory for outputs named `name` in `directory`, owned by this process.

    `directory` is opened beneath its data root (PermissionDenied naming `output_prefix` if a
    component is a symlink); stale staging directories for `name` there are removed first.
    """
    output = open_dir(directory, roots, "output_prefix", create=True)
    try:
        remove_stale(output, name)
        for _ in range(100):
            stage_name = f".{name}.partial-{secrets.token_hex(4)}"
            try:
                os.mkdir(stage_name, 0o700, dir_fd=output.fd)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"{directory}: no free staging name for {name!r}")
        stage = Stage(output, stage_name, output.subdir(stage_name))
        owner = stage.directory.open(OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(owner, "w") as handle:
            handle.write(_owner_token())
    except BaseException:
        output.close()
        raise
    with _lock:
        _live.add(_identity(stage.directory))
    return stage


def release(stage: Stage) -> None:
    """Removes a staging directory once its job has ended (published, failed or cancelled)."""
    with _lock:
        _live.discard(_identity(stage.directory))
    try:
        stage.output.rmtree(stage.name)
    except (Escape, OSError) as exc:
        logger.warning("could not remove staging %s/%s: %s", stage.output.path, stage.name, exc)
    stage.directory.close()
    stage.output.close()


def _owner_alive(directory: Dir, name: str) -> bool:
    try:
        with directory.subdir(name) as stage, stage.fdopen(OWNER_FILE) as handle:
            pid_text, started_text = handle.read(200).split()
        pid, started = int(pid_text), float(started_text)
    except (OSError, ValueError):
        # No owner recorded: treat it as live only while it could belong to a job of this run.
        info = directory.lstat(name)
        return info is not None and info.st_mtime >= _PROCESS_STARTED
    if pid == os.getpid() and started == _PROCESS_STARTED:
        return False  # ours, and not in `_live`: its job has ended
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def _is_stale(directory: Dir, name: str, live: set[tuple[int, int]]) -> bool:
    if _STAGE_NAME.fullmatch(name) is None:
        return False
    info = directory.lstat(name)
    if info is None or not stat.S_ISDIR(info.st_mode):
        return False  # gone, a file, or a symlink: never ours to delete
    if (info.st_dev, info.st_ino) in live:
        return False
    return not _owner_alive(directory, name)


def remove_stale(directory: Dir, name: str | None = None) -> list[str]:
    """Removes the stale staging directories for `name` (every name when None) in `directory`.

    Returns the names removed. Only this service's own staging names (`.{name}.partial-XXXXXXXX`)
    are candidates, and a symlink with such a name is left alone.
    """
    start = f".{name}.partial-" if name else "."
    with _lock:
        live = set(_live)
    removed = []
    for entry in directory.listdir():
        if entry.startswith(start) and ".partial-" in entry and _is_stale(directory, entry, live):
            logger.warning(
                "removing %s/%s, left by a preprocess job that did not finish",
                directory.path,
                entry,
            )
            with contextlib.suppress(OSError):
                directory.rmtree(entry)
                removed.append(entry)
    return removed


def sweep(roots: Sequence[Path], max_depth: int = 4, max_dirs: int = 20_000) -> list[Path]:
    """`remove_stale` in every directory under `roots` down to `max_depth` (service start).

    Bounded in depth and in directories visited so a huge shared volume does not stall the
    start; directories are opened beneath their root one by one, never through a symlink.
    """
    removed: list[Path] = []
    visited = 0
    started = time.monotonic()
    for root in roots:
        pending: list[tuple[Dir, int]] = [(Dir.open_anchor(root), 0)]
        while pending:
            here, depth = pending.pop()
            with here:
                if visited >= max_dirs:
                    continue  # only closing what is left
                visited += 1
                removed += [here.path / name for name in remove_stale(here)]
                if depth >= max_depth:
                    continue
                for entry in sorted(here.listdir()):
                    info = here.lstat(entry)
                    if info is None or not stat.S_ISDIR(info.st_mode) or ".partial-" in entry:
                        continue
                    with contextlib.suppress(OSError):
                        pending.append((here.subdir(entry), depth + 1))
    if visited >= max_dirs:
        logger.info("stale staging sweep stopped after %d directories", visited)
    logger.debug("stale staging sweep: %d dirs in %.2fs", visited, time.monotonic() - started)
    return removed
