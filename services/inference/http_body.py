"""JSON request bodies parsed and validated off the event loop, in a bounded pool of processes.

The HTTP front shares its event loop with the gRPC server: a 16 MiB body decoded and validated
on the loop (FastAPI's default) stalled gRPC health checks for seconds (issue 37). Routes built
with `OffLoopBodyRoute` read the body (already bounded by `--http-max-request-mb` in
`GuardMiddleware`), then decode it and validate it into the route's request model in a worker
process; FastAPI receives the validated model, whose re-validation is a no-op. Processes, not
threads: `json.loads` and pydantic-core's validation hold the GIL for their whole call (seconds
for a 16 MiB list of ints), which stalls the loop from any thread of this process. At most
`MAX_PENDING` bodies wait for or are in the pool; past that the request is answered 429. Small
bodies (under `INLINE_BYTES`) are parsed in place: the hop would cost more than the parse.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from services.inference.openai_protocol import ApiError

INLINE_BYTES = 64 * 1024
"""Bodies up to this size are decoded on the loop (microseconds); larger ones in the pool."""
WORKERS = 2
"""Processes decoding and validating large bodies."""
MAX_PENDING = 8
"""Large bodies queued or being parsed at once; one more is answered 429."""
MAX_ERRORS = 5
"""Validation errors sent back from a worker (the 400 answer names at most this many)."""


def _decode(body: bytes, model: type[BaseModel]) -> BaseModel:
    """`body` decoded and validated into `model`; RequestValidationError as FastAPI words it."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        position = getattr(exc, "pos", 0)
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error"}]
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [
            {"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"]}
            for e in exc.errors(include_url=False)[:MAX_ERRORS]
        ]
        raise RequestValidationError(errors) from None


def _decode_in_worker(body: bytes, model: type[BaseModel]) -> tuple[str, Any]:
    """`_decode` answered as data: ("ok", model) or ("invalid", its errors, picklable)."""
    try:
        return "ok", _decode(body, model)
    except RequestValidationError as exc:
        return "invalid", list(exc.errors())


def _ready() -> bool:
    return True


class BodyPool:
    """Worker processes behind a bounded count of pending bodies; `submit` never blocks the loop.

    The workers are started when the app is built, never on a request.
    """

    def __init__(self, workers: int, max_pending: int) -> None:
        self.workers = workers
        """Worker processes (0: never started, every large body is answered 429)."""
        self.max_pending = max_pending
        """Bodies waiting or being parsed at most."""
        self.pending = 0
        """Bodies submitted and not yet answered (changed on the event loop only)."""
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts the worker processes once (idempotent; returns when they are up)."""
        with self._lock:
            if self._executor is not None or self.workers == 0:
                return
            context = multiprocessing.get_context("spawn")  # never fork a threaded server
            self._executor = ProcessPoolExecutor(self.workers, mp_context=context)
            for future in [self._executor.submit(_ready) for _ in range(self.workers)]:
                future.result(timeout=120)

    async def submit(self, body: bytes, model: type[BaseModel]) -> BaseModel:
        """`_decode(body, model)` in a worker; ApiError 429 past `max_pending` bodies."""
        if self.pending >= self.max_pending or self._executor is None:
            raise ApiError(
                429,
                f"{self.max_pending} large request bodies are already being parsed; retry with "
                "backoff or send smaller requests",
                code="too_many_requests",
            )
        self.pending += 1
        try:
            future = self._executor.submit(_decode_in_worker, body, model)
            outcome, value = await asyncio.wrap_future(future)
        finally:
            self.pending -= 1
        if outcome == "invalid":
            raise RequestValidationError(value)
        return value


POOL = BodyPool(WORKERS, MAX_PENDING)
"""The pool every `OffLoopBodyRoute` uses."""


async def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """`_decode` in place for a small body, else in the worker pool (429 when it is full)."""
    if len(body) <= INLINE_BYTES:
        return _decode(body, model)
    return await POOL.submit(body, model)


class _ParsedRequest(Request):
    """A request whose `json()` is the body already parsed off the loop."""

    parsed: Any = None

    async def json(self) -> Any:
        return self.parsed


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    if route.body_field is None or len(route.dependant.body_params) != 1:
        return None
    annotation = route.body_field.field_info.annotation
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    return None


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON body is decoded and validated by `parse_body`, off the loop."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        original = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return original
        POOL.start()

        async def handler(request: Request) -> Response:
            content_type = request.headers.get("content-type", "")
            if "json" not in content_type:
                return await original(request)  # FastAPI's own answer for other bodies
            parsed = _ParsedRequest(request.scope, request.receive)
            body = await parsed.body()
            if not body:
                return await original(request)
            parsed.parsed = await parse_body(body, model)
            return await original(parsed)

        return handler
