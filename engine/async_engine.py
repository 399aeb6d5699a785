"""The engine front for the gRPC server: requests in from asyncio, events out to asyncio.

Requests arrive through `stream()` (an async iterator of the request's StepEvents). One
`EngineThread` — the thread that loaded the model, when `build_serving_engine` made it — runs
`engine.step()` back to back while any request is live and is the only thread that touches the
model, so scoring and shutdown go through it too (`run`, `run_blocking`). Each step's events are
posted to the event loop (`call_soon_threadsafe`) and routed to their request's queue there; the
engine thread never waits for the loop between two steps. Leaving `stream()` early (the client
cancelled, or the server is stopping) cancels the request, and the engine drops its rows at the
next step.

A caller that answers once, at the end (unary Generate, a non-streamed completion), asks for
`stream(..., hold=True)`: the engine thread keeps that request's events until its last sequence
finishes (or it fails) and posts them together. Waking the loop at every step costs the engine
thread the GIL while the loop routes the events and resumes each waiting coroutine (8 unary
requests on two cores: 2-7% of a small model's step in paired runs, up to 20% in one run;
bench/RESULTS.md). Events carry the time the engine handed them over (`time_s`), so latency
metrics stay per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine.engine import Engine
from engine.engine_thread import EngineThread, StepFailure
from engine.requests import StepEvent
from engine.sampling import SamplingConfig

T = TypeVar("T")


class AsyncEngine:
    """Async front end of an Engine (use it inside one running event loop).

    `worker` is the thread that owns the model (the one that loaded it); without one, a thread
    of its own is started.
    """

    def __init__(self, engine: Engine, worker: EngineThread | None = None) -> None:
        self.engine = engine
        self._worker = worker if worker is not None else EngineThread()
        self._queues: dict[int, asyncio.Queue[StepEvent | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Held requests: open sequences left, and the events kept back (engine thread + loop).
        self._hold_lock = threading.Lock()
        self._hold_open: dict[int, int] = {}
        self._held: dict[int, list[StepEvent]] = {}
        self._worker.drive(engine, self._post)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine's thread (between steps)."""
        return await asyncio.wrap_future(self._worker.call(fn))

    async def stream(
        self,
        prompt_ids: list[int],
        config: SamplingConfig,
        *,
        hold: bool = False,
        adapter: str = "",
    ) -> AsyncIterator[StepEvent]:
        """Events of one request until every sequence finished; cancels it when left early.
        `hold`: the events come together once the request ends (see the module docstring);
        `adapter`: the LoRA adapter it runs with ("": the base model)."""
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
        request_id = self.engine.submit(prompt_ids, config, adapter)
        self._queues[request_id] = queue
        open_sequences = config.num_return_sequences
        if hold:
            # Events of a step the engine ran before this line are posted as usual, earlier
            # than the held ones: the order is kept.
            with self._hold_lock:
                self._hold_open[request_id] = open_sequences
        self._worker.wake()
        try:
            while open_sequences:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # this request alone failed in the engine
                    open_sequences = 0
                    raise item.error
                if item.finish is not None:
                    open_sequences -= 1
                yield item
        finally:
            self._queues.pop(request_id, None)
            if hold:
                with self._hold_lock:
                    self._hold_open.pop(request_id, None)
                    self._held.pop(request_id, None)
            if open_sequences:
                self.engine.cancel(request_id)
                self._worker.wake()

    def _post(self, events: list[StepEvent] | StepFailure) -> None:
        """On the engine thread: hand one step's events (or its failure) to the event loop,
        keeping back those of held requests until their request ends."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if isinstance(events, StepFailure):
            with self._hold_lock:
                failed = (
                    self._hold_open.keys() if events.request_ids is None else events.request_ids
                )
                for request_id in list(failed):
                    self._hold_open.pop(request_id, None)
                    self._held.pop(request_id, None)
        else:
            now = time.perf_counter()
            for event in events:
                event.time_s = now
            if self._hold_open:
                events = self._release(events)
                if not events:
                    return
        # RuntimeError: the loop closed meanwhile (server stopped): nobody listens.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._route, events)

    def _release(self, events: list[StepEvent]) -> list[StepEvent]:
        """The events to post now: those of requests not held, and every event of a held
        request whose last sequence finished (or that failed) in this step."""
        out: list[StepEvent] = []
        with self._hold_lock:
            for event in events:
                rid = event.request_id
                open_left = self._hold_open.get(rid)
                if open_left is None:
                    out.append(event)
                    continue
                self._held.setdefault(rid, []).append(event)
                if event.finish is not None:
                    open_left -= 1
                if open_left <= 0 or event.error is not None:
                    del self._hold_open[rid]
                    out += self._held.pop(rid)
                else:
                    self._hold_open[rid] = open_left
        return out

    def _route(self, events: list[StepEvent] | StepFailure) -> None:
        """On the event loop: events to their requests' queues (a failed step's error to each
        request it dropped; requests submitted after it go on)."""
        if isinstance(events, StepFailure):
            failed = self._queues.keys() if events.request_ids is None else events.request_ids
            for request_id in list(failed):
                queue = self._queues.pop(request_id, None)
                if queue is not None:
                    queue.put_nowait(events.error)
            return
        for event in events:
            target = self._queues.get(event.request_id)
            if target is not None:
                target.put_nowait(event)

    def run_blocking(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run `fn` on the engine thread from a thread outside the event loop (server stop)."""
        return self._worker.call(fn).result(timeout_s)

    async def close(self) -> None:
        """Stop the engine thread (after the step in progress)."""
        await asyncio.to_thread(self._worker.stop, 10.0)
