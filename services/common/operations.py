"""Long-running operations: a thread-safe store, the handle a job reports through, a thread runner.

Jobs run in worker threads (or report from processes through their parent) and update their
operation through an `OperationHandle`; gRPC watchers are asyncio coroutines. Every change replaces
the stored `Operation` with a new snapshot under one lock and is pushed, in order, to each watcher's
event loop with `call_soon_threadsafe`. Records persist in the service's state database
(`state_db`, SQLite) on every state change and at most every `PERSIST_INTERVAL_S` for progress,
so a restart keeps finished jobs. A restarted server fails the operations its dead predecessor
left unfinished with the true reason, after stopping every process they had started
(`job_processes`) and only then releasing their output claims.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import grpc
from google.protobuf.message import Message

from meshline.common.v1 import operations_pb2
from services.common.errors import InvalidArgument, NotFound
from services.common.job_processes import stop_local
from services.common.metrics import OPERATIONS as OPERATIONS_METRICS
from services.common.operation_jobs import OperationHandle, run_in_thread
from services.common.operation_records import read_records
from services.common.operation_watch import Watcher
from services.common.progress import RateMeter
from services.common.state_db import ProcessRecord, StateDB

logger = logging.getLogger(__name__)

Operation = operations_pb2.Operation
State = operations_pb2.OperationState
PENDING, RUNNING = operations_pb2.OPERATION_STATE_PENDING, operations_pb2.OPERATION_STATE_RUNNING
SUCCEEDED, FAILED = operations_pb2.OPERATION_STATE_SUCCEEDED, operations_pb2.OPERATION_STATE_FAILED
CANCELLED = operations_pb2.OPERATION_STATE_CANCELLED
UNSPECIFIED = operations_pb2.OPERATION_STATE_UNSPECIFIED

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
PERSIST_INTERVAL_S = 10.0
_KIND = re.compile(r"[a-z][a-z0-9_-]{0,63}")
Stopper = Callable[[ProcessRecord], str]
"""Stops what a job recorded in `processes` still runs; returns what it did, for the record."""


def _copy(operation: Operation) -> Operation:
    duplicate = Operation()
    duplicate.CopyFrom(operation)
    return duplicate


class OperationsStore:
    """Every operation of one server: create, update through handles, get, list, cancel, wait, watch."""

    def __init__(
        self,
        state_dir: Path | str | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        stoppers: Mapping[str, Stopper] | None = None,
    ) -> None:
        """`stoppers` stop, by launcher, what a dead predecessor's jobs still run (at load);
        "local" (`job_processes.stop_local`) is always there."""
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self._clock = clock
        self._stoppers: dict[str, Stopper] = {"local": stop_local, **(stoppers or {})}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ops: dict[str, Operation] = {}
        self._handles: dict[str, OperationHandle] = {}
        self._meters: dict[str, RateMeter] = {}
        self._watchers: dict[str, list[Watcher]] = collections.defaultdict(list)
        self._version: dict[str, int] = collections.defaultdict(int)
        self._io_lock = threading.Lock()
        self._written: dict[str, int] = {}
        self._last_persist: dict[str, float] = {}
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        self.db = StateDB(self.state_dir)
        """The durable tables: operations, output claims, job processes."""
        if self.state_dir is not None:
            self._load()
        OPERATIONS_METRICS.add(self)

    def _load(self) -> None:
        assert self.state_dir is not None
        stored_names = {stored.operation.name for stored in self.db.operations()}
        for legacy in read_records(self.state_dir):
            # JSON records of servers before the database: imported once, then left as they are.
            if legacy.name not in stored_names:
                self.db.put_operation(legacy)
        for stored in self.db.operations():
            operation = stored.operation
            if not operation.done:
                if stored.owner_alive:
                    continue  # another live server over this directory runs it
                self._fail_orphan(operation, stored.owner_pid)
            self._ops[operation.name] = operation
        if self._ops:
            logger.info("loaded %d operations from %s", len(self._ops), self.db.path)

    def _fail_orphan(self, operation: Operation, owner_pid: int) -> None:
        """FAILED UNAVAILABLE for an unfinished operation of a dead server, its processes stopped."""
        previous = State.Name(operation.state)
        record = self.db.process(operation.name)
        stopped = ""
        if record is not None:
            stopper = self._stoppers.get(record.launcher)
            if stopper is None:
                stopped = (
                    f"; its {record.launcher} job ({record.token}) cannot be stopped by this "
                    "server: stop it by hand"
                )
            else:
                try:
                    stopped = f"; {stopper(record)}"
                except Exception as exc:  # the server must start; the message says what is left
                    logger.exception("%s: could not stop its job", operation.name)
                    stopped = (
                        f"; stopping its {record.launcher} job ({record.token}) failed "
                        f"({type(exc).__name__}: {exc}): stop it by hand"
                    )
        operation.state = FAILED
        operation.done = True
        operation.error.code = grpc.StatusCode.UNAVAILABLE.value[0]
        operation.error.message = (
            f"server restarted while the operation was {previous}: the server process "
            f"(pid {owner_pid}) ended before the job finished{stopped}; start it again"
        )
        operation.update_time.GetCurrentTime()
        operation.end_time.GetCurrentTime()
        # Done: the same write drops its claims and process records.
        self.db.put_operation(operation)
        logger.warning("%s: %s", operation.name, operation.error.message)

    def record_process(self, record: ProcessRecord) -> None:
        """Remembers the processes a job started, so a restarted server can stop them."""
        self.db.record_process(record)

    # -- updates (any thread) -------------------------------------------------------------

    @staticmethod
    def new_name(kind: str) -> str:
        """A fresh operation name of `kind` (claims are taken under it before it is created)."""
        if not _KIND.fullmatch(kind):
            raise ValueError(f"operation kind {kind!r} must match {_KIND.pattern}")
        return f"operations/{kind}-{uuid.uuid4().hex[:12]}"

    def create(
        self, kind: str, metadata: Message | None = None, *, name: str | None = None
    ) -> OperationHandle:
        """A new PENDING operation of `kind` ("train", "convert", ...) and the handle to drive it.

        `name` is one from `new_name(kind)`; by default a fresh one.
        """
        fresh = self.new_name(kind)
        if name is not None and not name.startswith(fresh.rsplit("-", 1)[0] + "-"):
            raise ValueError(f"operation name {name!r} is not one of kind {kind!r}")
        name = name or fresh
        operation = Operation(name=name, kind=kind, state=PENDING)
        operation.create_time.GetCurrentTime()
        operation.update_time.CopyFrom(operation.create_time)
        if metadata is not None:
            operation.metadata.Pack(metadata)
        handle = OperationHandle(self, name)
        with self._lock:
            self._handles[name] = handle
            self._meters[name] = RateMeter()
            self._publish(operation)
        self._persist(name)
        return handle

    def _publish(self, operation: Operation) -> None:
        """Stores a new snapshot and sends it to the watchers (caller holds the lock)."""
        name = operation.name
        self._ops[name] = operation
        self._version[name] += 1
        self._watchers[name] = [w for w in self._watchers[name] if w.push(operation)]

    def _update(
        self, name: str, change: Callable[[Operation], None], *, final: bool = False
    ) -> bool:
        """Applies `change` to a copy of the current snapshot; False if the operation is done."""
        with self._lock:
            current = self._ops[name]
            if current.done:
                return False
            operation = _copy(current)
            change(operation)
            operation.update_time.GetCurrentTime()
            if final:
                operation.done = True
                operation.end_time.CopyFrom(operation.update_time)
                operation.progress.ClearField("eta_seconds")
                self._meters.pop(name, None)
            self._publish(operation)
            now = self._clock()
            persist = final or now - self._last_persist.get(name, -PERSIST_INTERVAL_S) >= (
                PERSIST_INTERVAL_S
            )
            if persist:
                self._last_persist[name] = now
        if persist:
            self._persist(name)
        return True

    def _persist(self, name: str) -> None:
        with self._lock:
            operation, version = self._ops[name], self._version[name]
        # Records are written outside the store lock; versions keep a slow older write from
        # replacing a newer one.
        with self._io_lock:
            if self._written.get(name, 0) >= version:
                return
            self.db.put_operation(operation)
            self._written[name] = version

    def mark_running(self, name: str) -> None:
        """PENDING → RUNNING (a no-op once running); called through `OperationHandle.start`."""

        def change(operation: Operation) -> None:
            operation.state = RUNNING

        with self._lock:
            pending = self._ops[name].state == PENDING
        if pending:
            self._update(name, change)

    def record_progress(
        self,
        name: str,
        completed: float,
        total: float | None,
        unit: str | None,
        message: str | None,
        metadata: Message | None,
    ) -> None:
        """Stores a progress report and its rate/ETA; called through `OperationHandle.progress`."""
        with self._lock:
            meter = self._meters.get(name)
            if meter is None:
                return
            rate = meter.add(self._clock(), completed)

        def change(operation: Operation) -> None:
            operation.state = RUNNING
            progress = operation.progress
            progress.completed = completed
            if total is not None:
                progress.total = total
            if unit is not None:
                progress.unit = unit
            if message is not None:
                progress.message = message
            progress.rate = rate
            if progress.total > 0 and rate > 0:
                progress.eta_seconds = max(0.0, progress.total - completed) / rate
            else:
                progress.ClearField("eta_seconds")
            if metadata is not None:
                operation.metadata.Pack(metadata)

        self._update(name, change)

    def finish(
        self,
        name: str,
        state: operations_pb2.OperationState,
        response: Message | None = None,
        error: tuple[int, str] | None = None,
    ) -> bool:
        """Moves `name` to its final `state`; False (and a warning) if it had already finished.

        Jobs finish through their `OperationHandle`; `shutdown` finishes the stragglers here.
        """

        def change(operation: Operation) -> None:
            operation.state = state
            if response is not None:
                operation.response.Pack(response)
            if error is not None:
                operation.error.code, operation.error.message = error

        finished = self._update(name, change, final=True)
        if finished:
            # Only now, with the final record written, may `shutdown` consider the job ended.
            with self._lock:
                self._handles.pop(name, None)
                self._changed.notify_all()
        else:
            logger.warning("operation %s already finished; ignoring %s", name, State.Name(state))
        return finished

    # -- queries (any thread) ---------------------------------------------------------------

    def get(self, name: str) -> Operation:
        """The latest snapshot of `name`; NotFound if this server has no such operation."""
        with self._lock:
            operation = self._ops.get(name)
        if operation is None:
            raise _not_found(name)
        return _copy(operation)

    def list(
        self,
        kind: str = "",
        state: operations_pb2.OperationState = UNSPECIFIED,
        page_size: int = DEFAULT_PAGE_SIZE,
        page_token: str = "",
    ) -> tuple[list[Operation], str]:
        """Operations newest first, filtered by `kind` and `state`; returns (page, next token)."""
        if page_size < 0:
            raise InvalidArgument(
                "page_size", f"must be >= 0 (0 = {DEFAULT_PAGE_SIZE}), got {page_size}"
            )
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = _decode_token(page_token) if page_token else None
        with self._lock:
            snapshot = list(self._ops.values())
        ordered = sorted(snapshot, key=_sort_key, reverse=True)
        selected = [
            op
            for op in ordered
            if (not kind or op.kind == kind)
            and (state == UNSPECIFIED or op.state == state)
            and (after is None or _sort_key(op) < after)
        ]
        page = [_copy(op) for op in selected[:size]]
        next_token = _encode_token(_sort_key(page[-1])) if len(selected) > size else ""
        return page, next_token

    def cancel(self, name: str) -> Operation:
        """Asks the job to stop (its handle's `cancel_requested`); finished ones are unchanged."""
        with self._lock:
            handle = self._handles.get(name)
        if handle is not None:
            handle.cancel_requested.set()
            logger.info("cancellation requested for %s", name)
        return self.get(name)

    def _subscribe(self, name: str) -> tuple[Watcher, Operation]:
        watcher = Watcher(asyncio.get_running_loop())
        with self._lock:
            operation = self._ops.get(name)
            if operation is not None and not operation.done:
                self._watchers[name].append(watcher)
        if operation is None:
            raise _not_found(name)
        return watcher, operation

    def _unsubscribe(self, name: str, watcher: Watcher) -> None:
        with self._lock:
            if watcher in self._watchers.get(name, ()):
                self._watchers[name].remove(watcher)

    async def watch(self, name: str) -> AsyncIterator[Operation]:
        """Yields the current snapshot, then every change in order; ends after the final state."""
        watcher, operation = self._subscribe(name)
        try:
            yield _copy(operation)
            while not operation.done:
                operation = await watcher.next()
                yield _copy(operation)
        finally:
            self._unsubscribe(name, watcher)

    async def wait(self, name: str, timeout_s: float | None = None) -> Operation:
        """The operation once done, or its latest snapshot after `timeout_s` seconds."""
        if timeout_s is not None and timeout_s < 0:
            raise InvalidArgument("timeout_seconds", f"must be >= 0, got {timeout_s}")
        watcher, operation = self._subscribe(name)
        try:
            deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
            while not operation.done:
                remaining = (
                    None if deadline is None else deadline - asyncio.get_running_loop().time()
                )
                if remaining is not None and remaining <= 0:
                    break
                try:
                    operation = await asyncio.wait_for(watcher.next(), remaining)
                except asyncio.TimeoutError:
                    break
        finally:
            self._unsubscribe(name, watcher)
        return self.get(name)

    def shutdown(self, timeout_s: float) -> None:
        """On server stop: cancels running jobs, waits up to `timeout_s`, fails the stragglers."""
        with self._lock:
            handles = list(self._handles.values())
        for handle in handles:
            handle.cancel_requested.set()
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._handles and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            stragglers = list(self._handles)
        for name in stragglers:
            self.finish(
                name,
                FAILED,
                error=(
                    grpc.StatusCode.UNAVAILABLE.value[0],
                    f"server stopped before the job finished (it did not stop within {timeout_s:g}s "
                    "of being cancelled); start it again",
                ),
            )
        if handles:
            logger.info(
                "operations at shutdown: %d cancelled, %d did not stop in time",
                len(handles) - len(stragglers),
                len(stragglers),
            )


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"no operation named {name!r} on this server (names look like 'operations/train-2f1c9a'; "
        "ListOperations lists them)"
    )


def _sort_key(operation: Operation) -> tuple[int, str]:
    return operation.create_time.ToNanoseconds(), operation.name


def _encode_token(key: tuple[int, str]) -> str:
    return base64.urlsafe_b64encode(f"{key[0]}:{key[1]}".encode()).decode("ascii")


def _decode_token(token: str) -> tuple[int, str]:
    try:
        nanos, name = base64.urlsafe_b64decode(token.encode("ascii")).decode().split(":", 1)
        return int(nanos), name
    except (ValueError, UnicodeError) as exc:
        raise InvalidArgument(
            "page_token", "is not a token from a previous ListOperations response"
        ) from exc


__all__ = [
    "CANCELLED",
    "FAILED",
    "PENDING",
    "RUNNING",
    "SUCCEEDED",
    "UNSPECIFIED",
    "OperationHandle",
    "OperationsStore",
    "run_in_thread",
]
