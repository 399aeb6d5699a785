"""Streaming and cancellation for the HTTP front: merged engine streams, server-sent events,
and cancelling a plain request whose client went away."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.inference.metrics import metered
from services.inference.openai_protocol import ApiError, invalid
from services.inference.serving import ServingEngine

log = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.25
"""How often a plain (non-streamed) request checks whether its client is still there."""


async def merged(
    engine: ServingEngine, prompts: list[list[int]], config: Any, adapter: str = ""
) -> AsyncIterator[tuple[int, Any]]:
    """Events of one engine request per prompt (with LoRA adapter `adapter`, "" for none),
    interleaved as they come; leaving early (client gone) cancels every request."""
    queue: asyncio.Queue[tuple[int, Any] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, prompt: list[int]) -> None:
        try:
            async for event in metered(engine.front, prompt, config, "http", adapter=adapter):
                queue.put_nowait((i, event))
        except ValueError as exc:
            queue.put_nowait(invalid("prompt", str(exc)))
        except Exception as exc:  # forwarded to the consumer, which reports it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
    open_tasks = len(tasks)
    try:
        while open_tasks:
            item = await queue.get()
            if item is None:
                open_tasks -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events: one `data: <json>` per chunk, then `data: [DONE]`. An error after the
    stream started is sent as an error object (the status line is already out)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except ApiError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n".encode()
        except Exception as exc:
            incident = uuid.uuid4().hex[:12]
            log.error("stream failed", exc_info=exc, extra={"incident": incident})
            error = ApiError(500, f"internal error; the server log has incident {incident}")
            yield f"data: {json.dumps(error.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ApiError(499, "client disconnected", code="client_disconnected")
    finally:
        if not task.done():
            task.cancel()
