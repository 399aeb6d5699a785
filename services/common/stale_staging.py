"""Staging folders a killed job left behind: who owns one, when it is stale, removing them.

A job stages its output in a hidden folder beside the final one and removes it when it ends; a
job killed by SIGKILL, OOM or a lost node cannot. Each staging folder records its owner (process
id and start time) in `OWNER_FILE`, on which the owning job holds an exclusive `flock` for as long
as it runs: the kernel drops the lock when the holder dies, in any process or pod sharing the
volume. A folder is stale when it has one of the service's own staging names (`pattern`), is a
real directory (a symlink with such a name is never touched), is not a running job's of this
process (`live`), nobody holds its owner lock, and its recorded owner process is gone (a job of
a version that did not lock), or it records no owner and is older than this process. Removal goes through directories opened beneath the data
root (`services.common.safe_fs`), so nothing outside a root is ever deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from services.common.safe_fs import Dir

logger = logging.getLogger(__name__)

OWNER_FILE = ".owner"
"""Written into every staging folder when it is made: `{pid} {process start time}`."""
PROCESS_STARTED = psutil.Process().create_time()
"""When this process started (an owner-less staging folder older than this is stale)."""

Identity = tuple[int, int]
"""(st_dev, st_ino) of a directory."""


def owner_token() -> str:
    """The `OWNER_FILE` contents naming this process."""
    return f"{os.getpid()} {PROCESS_STARTED!r}"


def write_owner(stage: Dir) -> int:
    """Records this process as the owner of the just-made staging folder `stage` and locks it.

    Returns the descriptor holding the exclusive lock: the caller keeps it open while its job
    runs and closes it when the job ends (or the kernel does, when the process dies)."""
    fd = stage.open(OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, owner_token().encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owner_locked(stage: Dir) -> bool:
    """Whether a running job (in any process) holds the owner lock of `stage`."""
    try:
        fd = stage.open(OWNER_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def identity(directory: Dir) -> Identity:
    """The (device, inode) of an opened directory."""
    info = os.fstat(directory.fd)
    return info.st_dev, info.st_ino


def _owner_alive(directory: Dir, name: str) -> bool:
    try:
        with directory.subdir(name) as stage:
            if _owner_locked(stage):
                return True
            with stage.fdopen(OWNER_FILE) as handle:
                pid_text, started_text = handle.read(200).split()
        pid, started = int(pid_text), float(started_text)
    except (OSError, ValueError):
        # No owner recorded: treat it as live only while it could belong to a job of this run.
        info = directory.lstat(name)
        return info is not None and info.st_mtime >= PROCESS_STARTED
    if pid == os.getpid() and started == PROCESS_STARTED:
        return False  # ours, and not live: its job has ended
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def is_stale(directory: Dir, name: str, pattern: re.Pattern[str], live: set[Identity]) -> bool:
    """Whether entry `name` of `directory` is a staging folder nobody will finish."""
    if pattern.fullmatch(name) is None:
        return False
    info = directory.lstat(name)
    if info is None or not stat.S_ISDIR(info.st_mode):
        return False  # gone, a file, or a symlink: never ours to delete
    if (info.st_dev, info.st_ino) in live:
        return False
    return not _owner_alive(directory, name)


def remove_stale(
    directory: Dir, pattern: re.Pattern[str], live: set[Identity], what: str
) -> list[str]:
    """Removes the stale staging folders matching `pattern` in `directory`; returns their names."""
    removed = []
    for entry in directory.listdir():
        if is_stale(directory, entry, pattern, live):
            logger.warning(
                "removing %s/%s, left by a %s that did not finish", directory.path, entry, what
            )
            with contextlib.suppress(OSError):
                directory.rmtree(entry)
                removed.append(entry)
    return removed


def sweep(
    roots: Sequence[Path],
    pattern: re.Pattern[str],
    live: Callable[[], set[Identity]],
    what: str,
    max_depth: int = 4,
    max_dirs: int = 20_000,
) -> list[Path]:
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
                removed += [here.path / n for n in remove_stale(here, pattern, live(), what)]
                if depth >= max_depth:
                    continue
                for entry in sorted(here.listdir()):
                    info = here.lstat(entry)
                    if info is None or not stat.S_ISDIR(info.st_mode) or pattern.fullmatch(entry):
                        continue
                    with contextlib.suppress(OSError):
                        pending.append((here.subdir(entry), depth + 1))
    if visited >= max_dirs:
        logger.info("stale staging sweep stopped after %d directories", visited)
    logger.debug("stale staging sweep: %d dirs in %.2fs", visited, time.monotonic() - started)
    return removed
