"""The engine loop for the gRPC server: one asyncio task feeds one `Engine`, steps run in a thread.

Requests arrive through `stream()` (an async iterator of the request's StepEvents). The loop
task sleeps on an asyncio event while the engine is idle, otherwise runs `engine.step()` in a
single worker thread — the only thread that touches the model, so scoring goes through the same
worker — and routes each event to its request's queue. Leaving `stream()` early (the client
cancelled, or the server is stopping) cancels the request, and the engine drops its rows at the
next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.inference.engine import Engine
from services.inference.requests import StepEvent
from services.inference.sampling import SamplingConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """Async front end of an Engine (create and use it inside one running event loop)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._queues: dict[int, asyncio.Queue[StepEvent | BaseException]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine's worker thread (between steps)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def stream(
        self, prompt_ids: list[int], config: SamplingConfig
    ) -> AsyncIterator[StepEvent]:
        """Events of one request until every sequence finished; cancels it when left early."""
        self._ensure_loop()
        assert self._wake is not None
        request_id = self.engine.submit(prompt_ids, config)
        queue: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._wake.set()
        open_sequences = config.num_return_sequences
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
            if open_sequences:
                self.engine.cancel(request_id)
                self._wake.set()

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = await self.run(self.engine.step)
            except Exception as exc:  # a failed step fails its requests, not the server
                log.exception("engine step failed")
                for queue in self._queues.values():
                    queue.put_nowait(exc)
                self._queues.clear()
                await self.run(self.engine.reset)
                continue
            for event in events:
                target = self._queues.get(event.request_id)
                if target is not None:
                    target.put_nowait(event)

    def run_blocking(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run `fn` on the worker thread from a thread outside the event loop (server stop)."""
        return self._executor.submit(fn).result(timeout_s)

    async def close(self) -> None:
        """Stop the loop task and the worker thread."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
