"""The gRPC server every Meshline service runs: health, reflection, auth, TLS, limits, graceful stop.

```
bindings = [ServiceBinding(SERVICE_NAME, MyServicer(), add_MyServiceServicer_to_server)]
server, port, health = await create_server(bindings, ServerConfig(port=0))   # tests
run(bindings, config)                                                          # CLIs
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import tls
from services.common.auth import BearerAuth, read_token_file
from services.common.config import ServerConfig
from services.common.health import NOT_SERVING, SERVING, HealthServicer
from services.common.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from services.common.interceptors import GuardInterceptor
from services.common.logging import setup_logging
from services.common.metrics import (
    MetricsInterceptor,
    MetricsTLS,
    start_metrics_server,
)

logger = logging.getLogger(__name__)


class Companion(Protocol):
    """Something a binding runs beside the gRPC server in its event loop (an HTTP front)."""

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish for up to `grace_s`, then close."""


@dataclass(frozen=True)
class ServiceBinding:
    """One service hosted by a server."""

    name: str
    """Full proto service name, e.g. "meshline.inference.v1.InferenceService"."""
    servicer: object
    """The servicer instance (async methods)."""
    add_to_server: Callable[[object, grpc.aio.Server], None]
    """The generated `add_XServicer_to_server`."""
    on_stop: Callable[[float], None] | None = None
    """Called (in a worker thread) with the grace period when the server stops, e.g. to cancel
    and record running jobs; it should return within that many seconds."""
    max_request_bytes: int | None = None
    """Largest request message this service needs (None: the server's --max-message-mb); the
    server receives at most the smallest bound of its bindings, so an oversized request is
    refused by gRPC (RESOURCE_EXHAUSTED) before it is read into memory."""
    companion: Callable[[ServerConfig], Awaitable[Companion]] | None = None
    """Started by `serve` once the gRPC server listens (same event loop, same auth/TLS config),
    stopped before the bindings' `on_stop` hooks."""


def format_address(host: str, port: int) -> str:
    """`host:port`, bracketing IPv6 literals."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


async def create_server(
    bindings: Sequence[ServiceBinding], config: ServerConfig
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Builds, binds and starts a grpc.aio server hosting `bindings`; returns it, its port, health.

    Health reports SERVING for every binding and for "" (the whole server); reflection lists the
    bindings, health and reflection. Calls pass bearer-token auth (when configured), a concurrency
    limit and the error mapping, in that order.
    """
    names = [binding.name for binding in bindings]
    if len(set(names)) != len(names):
        raise ValueError(f"create_server: service names must be unique, got {names}")
    auth = None
    if config.auth_token_file is not None:
        auth = BearerAuth(read_token_file(config.auth_token_file))
    receive_limits = [b.max_request_bytes for b in bindings if b.max_request_bytes is not None]
    max_receive = min([config.max_message_bytes, *receive_limits])
    server = grpc.aio.server(
        interceptors=[MetricsInterceptor(), GuardInterceptor(config.max_concurrent_rpcs, auth)],
        options=[
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", max_receive),
            # Two servers must never share a port silently.
            ("grpc.so_reuseport", 0),
        ],
    )
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in names:
        await health.set(name, SERVING)
    reflection.enable_server_reflection(
        [*names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], server
    )

    address = format_address(config.host, config.port)
    try:
        if config.tls:
            assert config.tls_cert is not None and config.tls_key is not None
            credentials = tls.server_credentials(
                config.tls_cert, config.tls_key, config.tls_client_ca
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind {address} (--host/--port): {exc}") from exc
    if port == 0:
        raise OSError(f"cannot bind {address} (--host/--port): is the port in use?")
    await server.start()
    return server, port, health


async def shutdown(
    server: grpc.aio.Server,
    health: HealthServicer,
    bindings: Sequence[ServiceBinding],
    grace_s: float,
) -> None:
    """Graceful stop: health NOT_SERVING, refuse new calls, drain in-flight ones for `grace_s`.

    The bindings' `on_stop` hooks run alongside the drain, so jobs are asked to stop while the
    calls waiting on them finish.
    """
    await health.enter_graceful_shutdown()
    hooks = [asyncio.to_thread(binding.on_stop, grace_s) for binding in bindings if binding.on_stop]
    await asyncio.gather(server.stop(grace_s), *hooks)


def metrics_security(config: ServerConfig) -> dict[str, Any]:
    """`start_metrics_server`'s token and TLS for `--metrics-secure` (the service's own)."""
    if not config.metrics_secure:
        return {}
    tls = None
    if config.tls_cert is not None and config.tls_key is not None:
        tls = MetricsTLS(config.tls_cert, config.tls_key, config.tls_client_ca)
    token = read_token_file(config.auth_token_file) if config.auth_token_file else None
    return {"token": token, "tls": tls}


async def serve(
    bindings: Sequence[ServiceBinding],
    config: ServerConfig,
    *,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Runs the server until SIGTERM or SIGINT, then stops it gracefully (see `shutdown`).

    Logs one line `serving <names> on <host>:<port>` once listening, and calls `ready(port)`.
    """
    # Signals are ours before the port answers: a client that sees SERVING may send SIGTERM at
    # once (while a companion is still starting), and that must drain, not kill, the process.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    handled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            handled.append(sig)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            # Only the main thread of a process may own signals; elsewhere the caller stops us.
            logger.warning(
                "not handling %s here (%s); stop the server from its owner", sig.name, exc
            )
    try:
        await _serve_until_stopped(bindings, config, ready, stop, received)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


async def _serve_until_stopped(
    bindings: Sequence[ServiceBinding],
    config: ServerConfig,
    ready: Callable[[int], None] | None,
    stop: asyncio.Event,
    received: list[str],
) -> None:
    server, port, health = await create_server(bindings, config)
    metrics = None
    if config.metrics_port is not None:
        metrics = start_metrics_server(config.host, config.metrics_port, **metrics_security(config))
        logger.info(
            "metrics on %s://%s/metrics",
            "https" if config.metrics_secure and config.tls else "http",
            format_address(config.host, metrics.server_port),
            extra={"metrics_port": metrics.server_port, "metrics_secure": config.metrics_secure},
        )
    companions = [await b.companion(config) for b in bindings if b.companion is not None]
    names = ", ".join(binding.name for binding in bindings)
    address = format_address(config.host, port)
    logger.info(
        "serving %s on %s",
        names,
        address,
        extra={"port": port, "tls": config.tls, "auth": config.auth_token_file is not None},
    )
    if ready is not None:
        ready(port)

    try:
        terminated = asyncio.ensure_future(server.wait_for_termination())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({terminated, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if stop.is_set():
            logger.info(
                "%s received: draining in-flight calls for up to %gs", received[0], config.grace_s
            )
            await asyncio.gather(*(c.stop(config.grace_s) for c in companions))
            await shutdown(server, health, bindings, config.grace_s)
        terminated.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await terminated
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
    logger.info("stopped serving %s on %s", names, address)


def run(bindings: Sequence[ServiceBinding], config: ServerConfig) -> int:
    """Sets up logging from `config`, serves until a signal, returns the process exit code."""
    setup_logging(config.log_level, config.log_format)
    try:
        asyncio.run(serve(bindings, config))
    except (OSError, ValueError) as exc:
        # Start-up problems the user can fix (port taken, unreadable token or certificate).
        logger.error("%s", exc)
        return 1
    return 0


__all__ = [
    "NOT_SERVING",
    "SERVING",
    "HealthServicer",
    "ServiceBinding",
    "create_server",
    "format_address",
    "run",
    "serve",
    "shutdown",
]
