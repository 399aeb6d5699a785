"""The engine thread: one thread that loads the model, then runs every engine step and call.

Why one thread for both: on CPU each thread that runs a parallel torch op gets its own OpenMP
team. A model loaded (and repacked) on one thread and decoded on another leaves two teams on
the same cores, and the decoding team's helpers are put to sleep and woken several times per
token; everything on one thread measured 5.9 -> 3.2 ms/token for a small model on two cores.

The thread also drives the engine itself: while requests are live it calls `engine.step()`
back to back and hands each step's events to a callback (the asyncio side posts them to its
loop without the engine thread waiting for it), so no per-step round trip through the event
loop sits between two decode steps. Other work (loading, scoring, shutdown) is queued with
`call()` and runs between steps, on the same thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.requests import StepEvent

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class StepFailure:
    """A step raised `error`; the engine was reset and `request_ids` (its live requests) dropped
    (None: not known, every open request failed)."""

    error: BaseException
    request_ids: frozenset[int] | None


EventSink = Callable[[list[StepEvent] | StepFailure], None]
"""Receives each step's events, or the failure of a step (on the engine thread)."""


class EngineThread:
    """A daemon thread owning the model: queued calls first, then engine steps while there is work."""

    def __init__(self, name: str = "engine") -> None:
        self._cond = threading.Condition()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._engine: Any = None
        self._sink: EventSink | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread (between steps); its result or exception in the future."""
        future: Future[T] = Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the engine thread is stopped (the server is shutting down)")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def drive(self, engine: Any, sink: EventSink) -> None:
        """Step `engine` whenever it has work, handing every step's events to `sink`."""
        with self._cond:
            self._engine, self._sink = engine, sink
            self._cond.notify()

    def wake(self) -> None:
        """Look at the engine again (call after submitting or cancelling a request)."""
        with self._cond:
            self._cond.notify()

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish the call or step in progress, fail queued calls, and end the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def _has_work(self) -> bool:
        return self._engine is not None and self._engine.has_work()

    def _main(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._calls or self._has_work()):
                    self._cond.wait()
                if self._stopped:
                    pending, self._calls = list(self._calls), deque()
                    break
                calls, self._calls = list(self._calls), deque()
            for fn, future in calls:
                _run_into(fn, future)
            if self._has_work():
                self._step()
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine thread stopped before this call ran"))

    def _step(self) -> None:
        engine, sink = self._engine, self._sink
        assert engine is not None and sink is not None
        try:
            events = engine.step()
        except Exception as exc:  # a failed step fails its requests, not the server
            log.exception("engine step failed")
            dropped: frozenset[int] | None = None
            try:
                forgotten = engine.reset()
                dropped = None if forgotten is None else frozenset(forgotten)
            except Exception:
                log.exception("engine reset after a failed step failed")
            sink(StepFailure(exc, dropped))
            return
        if events:
            sink(events)


def _run_into(fn: Callable[[], Any], future: Future[Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as exc:  # delivered to the caller, who raises it
        future.set_exception(exc)
    else:
        future.set_result(result)
