"""Prometheus metrics every Meshline server exposes: gRPC calls, HTTP calls, operations.

`--metrics-port N` serves `/metrics` (text exposition format) on the server's `--host`; off by
default. Names follow Prometheus conventions: `meshline_<area>_<what>_total` counters,
`_seconds` histograms, plain gauges. Calls are counted by method and final status code, so
errors are the series whose `code` is not "OK" (gRPC) or whose `status` is >= 400 (HTTP).

Operations (preprocess, train, convert, evaluate jobs) are read from their stores at scrape time
by `OperationsCollector`: a count per kind and state, and the progress of every running one.

The endpoint is plain HTTP without auth unless `--metrics-secure` is given: then it reuses the
server's `--tls-cert/--tls-key` (HTTPS; mTLS with `--tls-client-ca`) and `--auth-token-file`
(scrapes send `Authorization: Bearer <token>`), so it is no weaker than the service's port.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import ssl
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from meshline.common.v1 import operations_pb2

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Seconds: from a health check (~1 ms) to a long generation or a blocking wait (minutes)."""

GRPC_REQUESTS = Counter(
    "meshline_grpc_requests_total",
    "gRPC calls finished, by service, method and status code (errors: code != OK).",
    ["service", "method", "code"],
)
GRPC_LATENCY = Histogram(
    "meshline_grpc_request_duration_seconds",
    "Wall time of gRPC calls from arrival to the last response message, by method.",
    ["service", "method"],
    buckets=LATENCY_BUCKETS,
)
GRPC_IN_FLIGHT = Gauge(
    "meshline_grpc_requests_in_flight", "gRPC calls being handled now.", ["service"]
)
HTTP_REQUESTS = Counter(
    "meshline_http_requests_total",
    "HTTP requests finished, by route, method and status (errors: status >= 400).",
    ["route", "method", "status"],
)
HTTP_LATENCY = Histogram(
    "meshline_http_request_duration_seconds",
    "Wall time of HTTP requests until the response (or its stream) ended, by route.",
    ["route", "method"],
    buckets=LATENCY_BUCKETS,
)


class MetricsServer(Protocol):
    """What `start_metrics_server` returns (a stdlib HTTP server in a daemon thread)."""

    server_port: int

    def shutdown(self) -> None: ...

    def server_close(self) -> None: ...


def start_metrics_server(
    host: str, port: int, *, token: str | None = None, tls: MetricsTLS | None = None
) -> MetricsServer:
    """Serves the default registry on `http(s)://host:port/metrics` from a daemon thread.

    Port 0 picks a free one (read it from `.server_port`). With `token`, a scrape must send
    `Authorization: Bearer <token>` (401 otherwise, no metric in the answer); with `tls`, the
    endpoint speaks HTTPS only (mTLS when `tls.client_ca` is set). Raises OSError naming the
    flag when the port cannot be bound.
    """
    if token is None and tls is None:
        try:
            httpd, _ = start_http_server(port, addr=host)
        except OSError as exc:
            raise OSError(f"cannot bind {host}:{port} for --metrics-port: {exc}") from exc
        return httpd
    app = _bearer_guard(make_wsgi_app(), token) if token is not None else make_wsgi_app()
    try:
        httpd = make_server(host, port, app, _QuietThreadingServer, handler_class=_QuietHandler)
    except OSError as exc:
        raise OSError(f"cannot bind {host}:{port} for --metrics-port: {exc}") from exc
    if tls is not None:
        # The handshake is deferred to the request's own thread: a client that never finishes
        # it holds one thread, not the accept loop.
        httpd.socket = tls.context().wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd


@dataclass(frozen=True)
class MetricsTLS:
    """The server's TLS files, reused by the metrics endpoint (`--metrics-secure`)."""

    cert: str
    """PEM certificate chain (`--tls-cert`)."""
    key: str
    """PEM private key (`--tls-key`)."""
    client_ca: str | None = None
    """PEM CA client certificates must chain to (`--tls-client-ca`; None: no client certs)."""

    def context(self) -> ssl.SSLContext:
        """A server-side SSL context over these files."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def _bearer_guard(app: Callable[..., Any], token: str) -> Callable[..., Any]:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        got = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(got, expected):
            start_response(
                "401 Unauthorized",
                [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")],
            )
            return [b"send 'Authorization: Bearer <token>' with the server's --auth-token-file\n"]
        return app(environ, start_response)

    return guarded


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one line per scrape would drown the service's log)."""


class _QuietThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed TLS handshake or a dropped scrape is the client's problem, not logged."""


def _split(method: str) -> tuple[str, str]:
    """ "/pkg.Service/Method" -> ("pkg.Service", "Method")."""
    service, _, name = method.lstrip("/").rpartition("/")
    return service or "unknown", name or method


def _code_name(context: grpc.aio.ServicerContext, failed: bool, cancelled: bool) -> str:
    if cancelled or (failed and context.cancelled()):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    return "UNKNOWN" if failed else "OK"


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every gRPC call by method and final status, and times it.

    Registered before the guard interceptor, so calls refused for auth (UNAUTHENTICATED) or load
    (RESOURCE_EXHAUSTED) are counted too. Wrapping keeps the handler's kind, as the guard does.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The method's handler wrapped with timing and counting."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method or ""
        hit = self._wrapped.get(method)
        if hit is None or hit[0] is not handler:
            hit = (handler, _wrap(handler, *_split(method)))
            self._wrapped[method] = hit
        return hit[1]


def _wrap(handler: grpc.RpcMethodHandler, service: str, method: str) -> grpc.RpcMethodHandler:
    kind = next(
        k
        for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        if getattr(handler, k, None) is not None
    )
    behavior = getattr(handler, kind)
    in_flight = GRPC_IN_FLIGHT.labels(service)
    latency = GRPC_LATENCY.labels(service, method)

    def record(
        context: grpc.aio.ServicerContext, start: float, failed: bool, cancelled: bool
    ) -> None:
        in_flight.dec()
        latency.observe(time.perf_counter() - start)
        GRPC_REQUESTS.labels(service, method, _code_name(context, failed, cancelled)).inc()

    if kind.endswith("_stream") and inspect.isasyncgenfunction(behavior):

        async def streamed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start, failed, cancelled = time.perf_counter(), True, False
            in_flight.inc()
            try:
                async for response in behavior(request, context):
                    yield response
                failed = False
            except (asyncio.CancelledError, GeneratorExit):
                cancelled = True  # the client went away (or the server is stopping)
                raise
            finally:
                record(context, start, failed, cancelled)

        wrapped: Callable[..., Any] = streamed
    else:

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start, failed, cancelled = time.perf_counter(), True, False
            in_flight.inc()
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                failed = False
                return result
            except asyncio.CancelledError:
                cancelled = True
                raise
            finally:
                record(context, start, failed, cancelled)

        wrapped = unary
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class OperationsCollector(Collector):
    """Scrape-time view of every registered operations store (job services)."""

    def __init__(self) -> None:
        self._stores: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, store: Any) -> None:
        """Report `store` (an OperationsStore) from now on, until it is garbage-collected."""
        with self._lock:
            self._stores.add(store)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """meshline_operations{kind,state} and meshline_operation_progress_ratio{kind,name}."""
        counts = GaugeMetricFamily(
            "meshline_operations",
            "Operations this server knows, by kind and state.",
            labels=["kind", "state"],
        )
        progress = GaugeMetricFamily(
            "meshline_operation_progress_ratio",
            "completed / total of each running operation (0 while the total is unknown).",
            labels=["kind", "name"],
        )
        completed = GaugeMetricFamily(
            "meshline_operation_progress_completed",
            "Units done by each running operation (its progress unit: steps, records, tasks...).",
            labels=["kind", "name", "unit"],
        )
        with self._lock:
            stores = list(self._stores)
        tally: dict[tuple[str, str], int] = {}
        for store in stores:
            operations, _ = store.list(page_size=1000)
            for op in operations:
                state = operations_pb2.OperationState.Name(op.state).removeprefix(
                    "OPERATION_STATE_"
                )
                key = (op.kind, state.lower())
                tally[key] = tally.get(key, 0) + 1
                if op.state == operations_pb2.OPERATION_STATE_RUNNING:
                    p = op.progress
                    ratio = p.completed / p.total if p.total > 0 else 0.0
                    progress.add_metric([op.kind, op.name], ratio)
                    completed.add_metric([op.kind, op.name, p.unit], p.completed)
        for (kind, state), n in sorted(tally.items()):
            counts.add_metric([kind, state], n)
        yield counts
        yield progress
        yield completed


OPERATIONS = OperationsCollector()
REGISTRY.register(OPERATIONS)
