"""Hidden staging directories of preprocess jobs, and the cleanup of those a killed job left.

A job writes under `.{name}.partial-XXXX` next to its outputs (one directory per job, never
shared) and removes it when it ends. A job that is killed (SIGKILL, OOM, a node lost) cannot, so
each staging directory has an `.owner` file that its job holds an exclusive `flock` on for as long
as it runs (and that records the owner's pid and start time). A directory is stale when no job
holds that lock — the kernel drops it when the holder dies, in any process or pod sharing the
volume — and the recorded owner is not another live process (a job of a version that did not
lock), or, for a directory without an owner file, when it is older than this process. A directory is registered as live before its owner file exists, so a job starting for
the same output in this process never mistakes a just-created directory for a stale one. Stale
directories are removed at service start (`sweep`) and when a job starts for the same output
(`remove_stale`); a running job's directory, here or in another process, is kept.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

OWNER_FILE = ".owner"
# `tempfile.mkdtemp`'s names: the prefix, then 8 characters of [a-z0-9_].
_STAGE_NAME = re.compile(r"\..+\.partial-[a-z0-9_]{8}")
_PROCESS_STARTED = psutil.Process().create_time()
_live: dict[Path, int] = {}
"""Staging directories of this process's running jobs, and the fd holding each owner lock."""
_lock = threading.Lock()


def _owner_token() -> str:
    return f"{os.getpid()} {_PROCESS_STARTED!r}"


def create(directory: Path, name: str) -> Path:
    """A new staging directory for outputs named `name` in `directory`, owned by this job."""
    with _lock:
        stage = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=directory))
        fd = os.open(
            stage / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(fd, fcntl.LOCK_EX)
        _live[stage] = fd
        os.write(fd, _owner_token().encode())
    return stage


def release(stage: Path) -> None:
    """Removes a staging directory once its job has ended (published, failed or cancelled)."""
    shutil.rmtree(stage, ignore_errors=True)
    with _lock:
        fd = _live.pop(stage, None)
    if fd is not None:
        os.close(fd)


def _owner_alive(stage: Path) -> bool:
    try:
        fd = os.open(stage / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        # No owner recorded: treat it as live only while it could belong to a job of this run.
        try:
            return stage.stat().st_mtime >= _PROCESS_STARTED
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True  # a running job holds it
    finally:
        os.close(fd)
    # Unlocked: stale, unless an owner that never locks (a job of an older version) still lives.
    try:
        pid_text, started_text = (stage / OWNER_FILE).read_text().split()
        pid, started = int(pid_text), float(started_text)
    except (OSError, ValueError):
        return False
    if pid == os.getpid():
        return False  # this process's jobs lock their folders; an unlocked one has ended
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def _stale(candidates: Iterable[Path]) -> list[Path]:
    with _lock:
        live = set(_live)
    return [
        path
        for path in candidates
        if path not in live
        and _STAGE_NAME.fullmatch(path.name) is not None
        and path.is_dir()
        and not path.is_symlink()
        and not _owner_alive(path)
    ]


def remove_stale(directory: Path, name: str | None = None) -> list[Path]:
    """Removes the stale staging directories for `name` (every name when None) in `directory`."""
    pattern = f".{name}.partial-*" if name else ".*.partial-*"
    removed = _stale(directory.glob(pattern))
    for path in removed:
        logger.warning("removing %s, left by a preprocess job that did not finish", path)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def sweep(roots: Sequence[Path], max_depth: int = 4, max_dirs: int = 20_000) -> list[Path]:
    """`remove_stale` in every directory under `roots` down to `max_depth` (service start).

    Bounded in depth and in directories visited so a huge shared volume does not stall the
    start; symlinked directories are not followed.
    """
    removed: list[Path] = []
    visited = 0
    started = time.monotonic()
    for root in roots:
        base_depth = len(root.parts)
        for current, dirs, _ in os.walk(root, followlinks=False):
            visited += 1
            here = Path(current)
            removed += remove_stale(here)
            dirs[:] = [d for d in dirs if ".partial-" not in d]
            if len(here.parts) - base_depth >= max_depth:
                dirs[:] = []
            if visited >= max_dirs:
                logger.info("stale staging sweep stopped after %d directories", visited)
                return removed
    logger.debug("stale staging sweep: %d dirs in %.2fs", visited, time.monotonic() - started)
    return removed
