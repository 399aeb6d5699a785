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

Requests sent together reach an idle engine one at a time: the front parses them one by one,
and once the first is prefilled both cores are busy with it, so the rest arrive milliseconds
later, are admitted a step or two apart and then decode at different lengths (a key mask and a
per-row cache write in every later step). With `batch_wait_s` the thread, woken from idle by a
request, waits until no further request has come for that long (at most `BATCH_WAIT_CAP`
times it in all) before its first step, as a dynamic batcher's queue delay does (Triton's
`max_queue_delay_microseconds`, TorchServe's `maxBatchDelay`). While rows are decoding, new
requests join at the next step without waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.requests import StepEvent

log = logging.getLogger(__name__)
T = TypeVar("T")
BATCH_WAIT_CAP = 5
"""An idle engine's first step waits at most this many `batch_wait_s` after the first wake."""


@dataclass(frozen=True)
class StepFailure:
    """A step raised `error`; the engine was reset and `request_ids` (its live requests) dropped
    (None: not known, every open request failed)."""

    error: BaseException
    request_ids: frozenset[int] | None


EventSink = Callable[[list[StepEvent] | StepFailure], None]
"""Receives each step's events, or the failure of a step (on the engine thread)."""


class EngineThread:
    """A daemon thread owning the model: queued calls first, then engine steps while there is work.

    `batch_wait_s`: how long a request waking an idle engine waits for others (module docstring;
    0: none)."""

    def __init__(self, name: str = "engine", *, batch_wait_s: float = 0.0) -> None:
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        self._batch_wait_s = batch_wait_s
        self._woken_at = 0.0
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
            self._woken_at = time.monotonic()
            self._cond.notify()

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish the call or step in progress, fail queued calls, and end the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def batch_wait_s(self) -> float:
        """How long a request waking an idle engine waits for others (0: none)."""
        return self._batch_wait_s

    @property
    def is_alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def _has_work(self) -> bool:
        return self._engine is not None and self._engine.has_work()

    def _main(self) -> None:
        while True:
            with self._cond:
                idle = not self._has_work()
                while not (self._stopped or self._calls or self._has_work()):
                    self._cond.wait()
                if idle and self._batch_wait_s > 0 and self._has_work():
                    self._gather_requests()
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

    def _gather_requests(self) -> None:
        """Wait (the lock released) until no request has come for `batch_wait_s`, the cap has
        passed, or a call or a stop came; the first step then admits what came together."""
        wait_s, now = self._batch_wait_s, time.monotonic()
        until = now + BATCH_WAIT_CAP * wait_s
        self._woken_at = now  # the first request counts from when this thread saw it
        while not (self._stopped or self._calls):
            left = min(self._woken_at + wait_s, until) - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

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
