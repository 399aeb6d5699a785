"""The durable state of one job service: operations, output claims and job processes in SQLite.

One database file, `meshline-state.sqlite3` under the service's `--state-dir` (an in-memory
database without one), in WAL mode so readers never wait for the writer, with `synchronous=FULL`
so a committed final state survives a power cut. Every write is one short transaction; the
connection is shared by the server's threads behind a lock (SQLite's own locking serialises
writers of several processes over one state dir). The schema is documented in docs/services.md.

Tables:
- `operations`: one row per operation, the serialized `Operation` plus the columns queries need,
  and its owner (the server process that runs it: pid and start time) so a second server over the
  same directory never judges a live server's jobs.
- `claims`: canonical output paths held by unfinished operations (see `claims.OutputClaims`).
- `processes`: what a job started outside the server process (the launcher's pid, its process
  group, start time and the job token its processes carry in their environment), so a restarted
  server can find and stop them (`job_processes`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from meshline.common.v1 import operations_pb2

DB_NAME = "meshline-state.sqlite3"
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS operations (
    name TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    state INTEGER NOT NULL,
    done INTEGER NOT NULL,
    create_ns INTEGER NOT NULL,
    update_ns INTEGER NOT NULL,
    owner_pid INTEGER NOT NULL,
    owner_started REAL NOT NULL,
    record BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS claims (
    path TEXT PRIMARY KEY,
    operation TEXT NOT NULL,
    created_ns INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS claims_by_operation ON claims (operation);
CREATE TABLE IF NOT EXISTS processes (
    operation TEXT PRIMARY KEY,
    launcher TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pgid INTEGER NOT NULL,
    started REAL NOT NULL,
    token TEXT NOT NULL,
    host TEXT NOT NULL
);
"""


def process_started(pid: int) -> float | None:
    """The start time of process `pid` (psutil's), or None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def same_process_alive(pid: int, started: float) -> bool:
    """Whether `pid` is still the process that started at `started` (not a reused pid)."""
    now = process_started(pid)
    return now is not None and abs(now - started) < 1.0


SELF_PID = os.getpid()
SELF_STARTED = process_started(SELF_PID) or time.time()


@dataclass(frozen=True)
class ProcessRecord:
    """Processes one job runs outside the server process."""

    operation: str
    """The operation's name."""
    launcher: str
    """How it was started ("local": a child process tree on this host)."""
    pid: int
    """The launcher process (torchrun's agent) the server started."""
    pgid: int
    """Its process group."""
    started: float
    """Its start time (psutil `create_time`), so a reused pid is never mistaken for it."""
    token: str
    """The job token every process of the job carries in its environment (`job_processes`)."""
    host: str
    """The host it runs on."""


@dataclass(frozen=True)
class StoredOperation:
    """An operation as read back, with the server process that owns it."""

    operation: operations_pb2.Operation
    """The last stored snapshot."""
    owner_pid: int
    """Pid of the server process that ran it."""
    owner_started: float
    """Start time of that process."""

    @property
    def owner_alive(self) -> bool:
        """Whether another, live server process owns it (this process never counts as that)."""
        if self.owner_pid == SELF_PID:
            # One process holds one store per state dir; an older store of this process (a test
            # restarting a store in place) is as gone as a killed server.
            return False
        return same_process_alive(self.owner_pid, self.owner_started)


class StateDB:
    """The service's durable tables (see the module docstring). Thread-safe."""

    def __init__(self, state_dir: Path | None) -> None:
        self.path = state_dir / DB_NAME if state_dir is not None else None
        self._lock = threading.RLock()
        self._db = sqlite3.connect(
            str(self.path) if self.path else ":memory:",
            timeout=30.0,
            check_same_thread=False,
            isolation_level=None,
        )
        with self._lock:
            if self.path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            found = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if found is None:
                self._db.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),)
                )
            elif int(found[0]) != SCHEMA_VERSION:
                raise ValueError(
                    f"--state-dir: {self.path} has schema version {found[0]}, this server "
                    f"reads {SCHEMA_VERSION}; point --state-dir at a new directory"
                )

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front (BEGIN IMMEDIATE) so checks and writes agree."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        """Closes the connection."""
        with self._lock:
            self._db.close()

    # -- operations -------------------------------------------------------------------------

    def put_operation(self, operation: operations_pb2.Operation) -> None:
        """Stores the latest snapshot of `operation`, owned by this process."""
        row = (
            operation.name,
            operation.kind,
            int(operation.state),
            int(operation.done),
            operation.create_time.ToNanoseconds(),
            operation.update_time.ToNanoseconds(),
            SELF_PID,
            SELF_STARTED,
            operation.SerializeToString(),
        )
        with self.transaction() as db:
            db.execute(
                "INSERT INTO operations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO "
                "UPDATE SET state=excluded.state, done=excluded.done, update_ns=excluded.update_ns,"
                " owner_pid=excluded.owner_pid, owner_started=excluded.owner_started,"
                " record=excluded.record",
                row,
            )
            if operation.done:
                # A finished operation holds nothing any more.
                db.execute("DELETE FROM claims WHERE operation=?", (operation.name,))
                db.execute("DELETE FROM processes WHERE operation=?", (operation.name,))

    def operations(self) -> list[StoredOperation]:
        """Every stored operation with its owner."""
        with self._lock:
            rows = self._db.execute(
                "SELECT record, owner_pid, owner_started FROM operations ORDER BY create_ns"
            ).fetchall()
        return [
            StoredOperation(operations_pb2.Operation.FromString(record), pid, started)
            for record, pid, started in rows
        ]

    def live_operation(self, name: str) -> bool:
        """Whether `name` is stored, unfinished, and owned by this or another live process."""
        with self._lock:
            row = self._db.execute(
                "SELECT done, owner_pid, owner_started FROM operations WHERE name=?", (name,)
            ).fetchone()
        if row is None:
            return False
        done, pid, started = row
        if done:
            return False
        return pid == SELF_PID or same_process_alive(pid, started)

    # -- claims ------------------------------------------------------------------------------

    def claims(self) -> dict[str, str]:
        """Every claimed path and the operation holding it."""
        with self._lock:
            return dict(self._db.execute("SELECT path, operation FROM claims").fetchall())

    def release_claims(self, operation: str) -> None:
        """Drops every claim of `operation`."""
        with self.transaction() as db:
            db.execute("DELETE FROM claims WHERE operation=?", (operation,))

    # -- processes ---------------------------------------------------------------------------

    def record_process(self, record: ProcessRecord) -> None:
        """Remembers the processes a job started (replacing an earlier record of the job)."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO processes VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.operation,
                    record.launcher,
                    record.pid,
                    record.pgid,
                    record.started,
                    record.token,
                    record.host,
                ),
            )

    def process(self, operation: str) -> ProcessRecord | None:
        """The recorded processes of `operation`, if it started any."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM processes WHERE operation=?", (operation,)
            ).fetchone()
        return ProcessRecord(*row) if row else None
