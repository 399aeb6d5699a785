"""Output claims: one running job per canonical output path, held in three places at once.

A job claims the SET of canonical paths it will write (resolved under the data roots; a sharded
preprocess job claims the shard prefix it writes, not the prefix it was given), all or none:

1. in this process (`OutputClaims._held`), so two jobs of one server never share a path;
2. in the state database (`StateDB` table `claims`), naming the holding operation, so the
   refusal can name it and a restarted server knows what its predecessor's jobs held;
3. on the file system: an exclusive `flock` on a lock file next to each path
   (`<parent>/.meshline-claim.<hash of the path>`), so the claim holds between processes and
   pods that share the volume, and ends only when every process holding the lock file is gone
   (the trainer hands it to its launcher process, so it outlives a crashed server for exactly as
   long as the training does). Lock files stay in place: deleting one would race a new claim.

Claims also conflict with a live claim on an ancestor or descendant path (a job writing
`out/` and another writing `out/sub` would mix their files).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from time import time_ns

from services.common.errors import Conflict, FailedPrecondition
from services.common.state_db import StateDB

LOCK_PREFIX = ".meshline-claim."


def lock_path(path: Path) -> Path:
    """The lock file that stands for output `path` (next to it, named by a hash of the path)."""
    digest = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return path.parent / f"{LOCK_PREFIX}{digest}"


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path`'s lock file; None if another holder has it."""
    lock = lock_path(path)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise FailedPrecondition(
            f"cannot create the claim lock {str(lock)!r} for {str(path)!r}: {exc.strerror}; the "
            "output's directory must be writable by the service"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


class OutputClaims:
    """The claims of one server (see the module docstring). Thread-safe."""

    def __init__(self, db: StateDB | None = None) -> None:
        self._db = db if db is not None else StateDB(None)
        self._lock = threading.Lock()
        self._held: Counter[Path] = Counter()
        self._owner: dict[Path, str] = {}
        self._fds: dict[str, list[int]] = {}

    def claim(
        self, operation: str, paths: Sequence[Path], refusal: Callable[[Path, str], str]
    ) -> None:
        """Claims every path in `paths` for `operation`, or none.

        Raises Conflict (ABORTED) with `refusal(path, holder)` for the first path another
        running job holds (`holder`: that operation's name, or "a job of another process").
        """
        with self._lock:
            for path in paths:
                for held in self._held:
                    if self._held[held] and _overlap(path, held):
                        raise Conflict(refusal(path, self._owner.get(held, "another job")))
            fds: list[int] = []
            try:
                with self._db.transaction() as db:
                    rows = db.execute("SELECT path, operation FROM claims").fetchall()
                    for path in paths:
                        for other, holder in rows:
                            if _overlap(path, Path(other)) and self._db.live_operation(holder):
                                raise Conflict(refusal(path, holder))
                    for path in paths:
                        fd = _try_lock(path)
                        if fd is None:
                            raise Conflict(refusal(path, "a job of another process"))
                        fds.append(fd)
                    for path in paths:
                        db.execute(
                            "INSERT OR REPLACE INTO claims VALUES (?, ?, ?)",
                            (str(path), operation, time_ns()),
                        )
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            for path in paths:
                self._held[path] += 1
                self._owner[path] = operation
            self._fds.setdefault(operation, []).extend(fds)

    def hold(self, operation: str, path: Path) -> None:
        """Claims `path` for `operation` without checking (a path named after a new operation)."""
        with self._lock:
            if not self._held[path]:
                fd = _try_lock(path)
                if fd is not None:
                    self._fds.setdefault(operation, []).append(fd)
            self._held[path] += 1
            self._owner.setdefault(path, operation)
            with self._db.transaction() as db:
                db.execute(
                    "INSERT OR IGNORE INTO claims VALUES (?, ?, ?)",
                    (str(path), operation, time_ns()),
                )

    def lock_fds(self, operation: str) -> list[int]:
        """The open lock files of `operation` (a launcher passes them on to its processes)."""
        with self._lock:
            return list(self._fds.get(operation, []))

    def release(self, operation: str, paths: Sequence[Path]) -> None:
        """Releases `operation`'s hold on each of `paths` (a no-op for paths it does not hold)."""
        with self._lock:
            for path in paths:
                if self._held[path] > 1:
                    self._held[path] -= 1
                else:
                    self._held.pop(path, None)
                    self._owner.pop(path, None)
            for fd in self._fds.pop(operation, []):
                os.close(fd)
            self._db.release_claims(operation)

    def __contains__(self, path: object) -> bool:
        with self._lock:
            return bool(self._held.get(path))  # type: ignore[call-overload]
