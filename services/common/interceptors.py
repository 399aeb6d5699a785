"""The one server interceptor every Meshline server runs: auth, a concurrency limit, error mapping.

They share one interceptor (one hop per call), and the wrapped handler of each method is built
once and cached, so a call pays a dict lookup plus a try/except around the servicer. Wrapping
keeps the handler's kind (unary or streaming, coroutine or async generator) so grpc.aio runs it
unchanged.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from services.common.auth import BearerAuth
from services.common.errors import MeshlineError, from_os_error

logger = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


def _kind(handler: grpc.RpcMethodHandler) -> str:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind, None) is not None:
            return kind
    raise ValueError(f"method handler {handler!r} has no behaviour")


class Undecodable:
    """Stands in for a unary request whose bytes did not parse (the call answers
    INVALID_ARGUMENT instead of grpc's UNKNOWN for an exception in the deserializer)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name = type_name
        self.error = error

    def message(self) -> str:
        """The status message: what was expected and what the parser said."""
        return (
            f"request body: not a valid {self.type_name} message "
            f"({type(self.error).__name__}: {self.error}); send a serialized {self.type_name}"
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, returning `Undecodable` instead of raising on bad bytes."""
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    type_name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request")

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return Undecodable(type_name, exc)

    return deserialize


def _rebuild(handler: grpc.RpcMethodHandler, kind: str, behavior: Callable[..., Any]) -> Any:
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    deserializer = handler.request_deserializer
    if kind.startswith("unary_"):
        deserializer = _tolerant(deserializer)
    return factory(
        behavior,
        request_deserializer=deserializer,
        response_serializer=handler.response_serializer,
    )


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())


async def abort_with(context: grpc.aio.ServicerContext, status: status_pb2.Status) -> None:
    """Ends the call with a google.rpc.Status (code, message and rich details in the trailers)."""
    await context.abort_with_status(rpc_status.to_status(status))


async def map_exception(method: str, context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Aborts the call with the status for `exc`: a MeshlineError's own, else INTERNAL (logged)."""
    exc = from_os_error(exc) or exc
    if isinstance(exc, MeshlineError):
        logger.info(
            "%s -> %s: %s", method, exc.code.name, exc.message, extra={"code": exc.code.name}
        )
        status = exc.to_status()
    else:
        incident = uuid.uuid4().hex[:12]
        logger.error(
            "uncaught %s in %s",
            type(exc).__name__,
            method,
            exc_info=exc,
            extra={"incident": incident},
        )
        message = (
            f"internal error in {method} ({type(exc).__name__}); "
            f"the server log has the traceback under incident {incident}"
        )
        status = status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=message)
    await abort_with(context, status)


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token auth (when `auth` is given), at most `limit` calls in flight, error mapping.

    Health checks skip auth and the limit, so probes answer without a token and under load. The
    limit is counted here rather than by grpc's `maximum_concurrent_rpcs` for that reason. An
    unauthenticated call never takes a slot. MeshlineError becomes its status code with details;
    any other exception INTERNAL with an incident id (never UNKNOWN).
    """

    def __init__(self, limit: int, auth: BearerAuth | None = None) -> None:
        self.limit = limit
        self.auth = auth
        self.in_flight = 0
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._denied: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """The method's guarded handler, or one that answers UNAUTHENTICATED."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method or ""
        exempt = method.startswith(HEALTH_PREFIX)
        if (
            self.auth is not None
            and not exempt
            and not self.auth.allows(handler_call_details.invocation_metadata)
        ):
            return self._cached(self._denied, method, handler, self._deny)
        return self._cached(self._guarded, method, handler, self._guard)

    @staticmethod
    def _cached(
        cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]],
        method: str,
        handler: grpc.RpcMethodHandler,
        build: Callable[[grpc.RpcMethodHandler, str], grpc.RpcMethodHandler],
    ) -> grpc.RpcMethodHandler:
        hit = cache.get(method)
        if hit is None or hit[0] is not handler:
            hit = (handler, build(handler, method))
            cache[method] = hit
        return hit[1]

    def _deny(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs 'authorization: Bearer <token>' metadata with the server's token",
            )

        return _rebuild(handler, _kind(handler), deny)

    async def _acquire(self, method: str, context: grpc.aio.ServicerContext) -> None:
        # One event loop runs every handler, so a plain counter is race-free.
        if self.in_flight >= self.limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: the server already has --max-concurrent-rpcs={self.limit} calls in "
                "flight; retry with backoff or raise the limit",
            )
        self.in_flight += 1

    def _guard(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        kind = _kind(handler)
        behavior = getattr(handler, kind)
        counted = not method.startswith(HEALTH_PREFIX)
        if kind.endswith("_stream") and inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await _refuse_undecodable(request, context)
                if counted:
                    await self._acquire(method, context)
                try:
                    async for response in behavior(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await map_exception(method, context, exc)
                finally:
                    if counted:
                        self.in_flight -= 1

            return _rebuild(handler, kind, stream)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if kind.startswith("unary_"):
                await _refuse_undecodable(request, context)
            if counted:
                await self._acquire(method, context)
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await map_exception(method, context, exc)
            finally:
                if counted:
                    self.in_flight -= 1

        return _rebuild(handler, kind, call)
