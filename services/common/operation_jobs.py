"""The job side of an operation: the handle a job reports through, and a thread runner.

This module knows the store only through `OperationUpdates`, the four calls a handle makes, so
it imports nothing from `services.common.operations` (which builds on it): no import cycle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import grpc
from google.protobuf.message import Message

from meshline.common.v1 import operations_pb2
from services.common.errors import Cancelled, MeshlineError, from_os_error

logger = logging.getLogger(__name__)


class OperationUpdates(Protocol):
    """What a handle needs from the store that holds its operation (`OperationsStore` is one)."""

    def get(self, name: str) -> operations_pb2.Operation:
        """The latest snapshot of operation `name`."""
        ...

    def mark_running(self, name: str) -> None:
        """PENDING → RUNNING (a no-op once running)."""
        ...

    def record_progress(
        self,
        name: str,
        completed: float,
        total: float | None,
        unit: str | None,
        message: str | None,
        metadata: Message | None,
    ) -> None:
        """Stores a progress report (None keeps the previous value)."""
        ...

    def finish(
        self,
        name: str,
        state: operations_pb2.OperationState,
        response: Message | None = None,
        error: tuple[int, str] | None = None,
    ) -> bool:
        """Moves to a final state; False if the operation had already finished."""
        ...


class OperationHandle:
    """What a job holds to report on its operation. Thread-safe; finishing twice is ignored."""

    def __init__(self, store: OperationUpdates, name: str) -> None:
        self.name = name
        self.cancel_requested = threading.Event()
        """Set when a client cancels (or the server stops); the job decides when it has stopped."""
        self._store = store

    @property
    def store(self) -> OperationUpdates:
        """The store this operation lives in."""
        return self._store

    @property
    def done(self) -> bool:
        """Whether the operation has reached a final state."""
        return self._store.get(self.name).done

    def start(self) -> None:
        """PENDING → RUNNING (a no-op once running)."""
        self._store.mark_running(self.name)

    def progress(
        self,
        completed: float,
        total: float | None = None,
        unit: str | None = None,
        message: str | None = None,
        metadata: Message | None = None,
    ) -> None:
        """Reports progress; None keeps the previous total/unit/message/metadata. Rate and ETA are
        derived by the store from the recent `completed` values."""
        self._store.record_progress(self.name, completed, total, unit, message, metadata)

    def check_cancelled(self) -> None:
        """Raises `errors.Cancelled` if cancellation was requested (call it between work units)."""
        if self.cancel_requested.is_set():
            raise Cancelled(f"{self.name} was cancelled")

    def succeed(self, response: Message | None = None) -> bool:
        """Finishes as SUCCEEDED with the typed `response`."""
        return self._store.finish(
            self.name, operations_pb2.OPERATION_STATE_SUCCEEDED, response=response
        )

    def fail(self, code: grpc.StatusCode, message: str) -> bool:
        """Finishes as FAILED with a status code and a message naming the input and the fix."""
        return self._store.finish(
            self.name, operations_pb2.OPERATION_STATE_FAILED, error=(code.value[0], message)
        )

    def cancelled(self) -> bool:
        """Finishes as CANCELLED (the job has stopped after `cancel_requested`)."""
        return self._store.finish(self.name, operations_pb2.OPERATION_STATE_CANCELLED)


def run_in_thread(
    store: OperationUpdates,
    handle: OperationHandle,
    fn: Callable[[OperationHandle], Message | None],
    on_exit: Callable[[], None] | None = None,
) -> threading.Thread:
    """Runs `fn(handle)` in a daemon thread and finishes the operation from how it ended.

    Returning gives SUCCEEDED with the returned response, or CANCELLED if cancellation had been
    requested (a job that stops early must not look complete); `errors.Cancelled` (from
    `handle.check_cancelled()`) gives CANCELLED; another MeshlineError FAILED with its code; a
    full disk (ENOSPC/EDQUOT) RESOURCE_EXHAUSTED naming the path; any other exception FAILED
    INTERNAL, logged with its traceback. A job that finished its operation itself is left as it
    finished it.

    `on_exit` runs once when the job is over, before the final state is stored, so a client that
    sees the operation done can reuse what the job held (`services.common.jobs` releases its
    output claim there). It runs also when `fn` never starts because the operation was
    cancelled first.
    """
    if handle.store is not store:
        raise ValueError(f"run_in_thread: {handle.name} belongs to another OperationsStore")

    def exit_hook() -> None:
        if on_exit is not None:
            on_exit()

    def work() -> None:
        if handle.cancel_requested.is_set():
            exit_hook()
            handle.cancelled()
            return
        handle.start()
        try:
            try:
                response = fn(handle)
            finally:
                exit_hook()
        except Cancelled:
            handle.cancelled()
        except MeshlineError as exc:
            handle.fail(exc.code, exc.message)
        except Exception as exc:
            mapped = from_os_error(exc)
            if mapped is not None:
                handle.fail(mapped.code, mapped.message)
                return
            logger.exception("operation %s failed", handle.name)
            handle.fail(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"[:1000])
        else:
            if handle.done:
                return
            if handle.cancel_requested.is_set():
                handle.cancelled()
            else:
                handle.succeed(response)

    thread = threading.Thread(target=work, name=f"op-{handle.name.rsplit('/', 1)[-1]}", daemon=True)
    thread.start()
    return thread
