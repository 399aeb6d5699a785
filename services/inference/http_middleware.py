"""ASGI middleware of the HTTP front: bearer auth, body-size and concurrency limits, metrics.

Pure ASGI (no response buffering), so streamed responses pass through untouched. `/health` skips
auth and the concurrency limit, as the gRPC health service does, so probes need no token.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.metrics import HTTP_LATENCY, HTTP_REQUESTS
from services.inference.http_config import HttpConfig
from services.inference.openai_protocol import ApiError

EXEMPT = ("/health",)
ROUTES = frozenset(
    {
        "/health",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)
"""Route labels of the metrics; any other path counts as "other" (bounded label values)."""
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
"""Method labels of the metrics; any other method counts as "other" (bounded label values)."""


def metric_labels(path: str, method: str, authenticated: bool) -> tuple[str, str]:
    """(route, method) labels, each from a fixed set: a client cannot mint new series.

    A request that failed auth is counted, but under ("other", "other"): nothing it sent
    chooses a label before the server knows who sent it.
    """
    if not authenticated:
        return "other", "other"
    return (path if path in ROUTES else "other"), (method if method in METHODS else "other")


class GuardMiddleware:
    """Auth (when a token is set), 413 past the body limit, 429 past the in-flight limit."""

    def __init__(self, app: ASGIApp, http: HttpConfig, auth_token: str | None = None) -> None:
        self.app = app
        self.max_bytes = http.max_request_bytes
        self.limit = http.max_concurrent_requests
        self.expected = f"Bearer {auth_token}".encode() if auth_token else None
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        start = time.perf_counter()
        status = [500]

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, send_counted, path)
        finally:
            authenticated = status[0] != 401
            route, method = metric_labels(path, scope.get("method", ""), authenticated)
            HTTP_LATENCY.labels(route, method).observe(time.perf_counter() - start)
            HTTP_REQUESTS.labels(route, method, _status_label(status[0])).inc()

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        if path in EXEMPT:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and not hmac.compare_digest(
            headers.get(b"authorization", b""), self.expected
        ):
            await _reply(
                send,
                ApiError(
                    401,
                    "send 'Authorization: Bearer <token>' with the server's token "
                    "(--auth-token-file); for the openai client set api_key to the token",
                    code="invalid_api_key",
                ),
            )
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _reply(send, self._too_large())
            return
        if self.in_flight >= self.limit:
            await _reply(
                send,
                ApiError(
                    429,
                    f"the server already has --http-max-concurrent-requests={self.limit} "
                    "requests in flight; retry with backoff",
                    code="too_many_requests",
                ),
            )
            return
        received = 0
        too_large = False

        async def receive_limited() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise self._too_large()
            return message

        replied = False

        async def send_checked(message: Message) -> None:
            # A chunked body over the limit: the app answers its body-parsing error, we 413.
            nonlocal replied
            if not too_large:
                await send(message)
            elif not replied:
                replied = True
                await _reply(send, self._too_large())

        self.in_flight += 1
        try:
            await self.app(scope, receive_limited, send_checked)
        finally:
            self.in_flight -= 1

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"request body over --http-max-request-mb ({self.max_bytes} bytes); send fewer or "
            "shorter prompts per request",
            code="request_too_large",
        )


def _status_label(status: int) -> str:
    """The status as a label; only 100..599 (what an ASGI app may send) are distinct values."""
    return str(status) if 100 <= status <= 599 else "other"


async def _reply(send: Send, error: ApiError) -> None:
    body: Any = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
