"""Runs the HTTP front (uvicorn) in the gRPC server's event loop, beside it, on the same engine.

`http_companion(...)` is what the inference binding hands to `services.common.server.serve`: it
binds `--host:--http-port` with the server's TLS files (mTLS when `--tls-client-ca` is set) and
bearer token, and stops with the server (in-flight requests get the grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator

import uvicorn

from services.common.auth import read_token_file
from services.common.config import ServerConfig
from services.common.server import Companion, format_address
from services.inference.config import InferenceServiceConfig
from services.inference.http_api import build_app
from services.inference.http_config import HttpConfig
from services.inference.reward_serving import ServingRewardModel
from services.inference.serving import ServingEngine

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the gRPC server owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpFront:
    """A started HTTP front; `port` is the bound port."""

    def __init__(self, server: _Server, task: asyncio.Task[None], port: int, sock: socket.socket):
        self._server = server
        self._task = task
        self._sock = sock
        self.port = port

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, give in-flight requests `grace_s`, then close."""
        self._server.config.timeout_graceful_shutdown = max(1, int(grace_s))
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sock.close()


async def start_http(
    engine: ServingEngine | ServingRewardModel | None,
    limits: InferenceServiceConfig,
    http: HttpConfig,
    server_config: ServerConfig,
) -> HttpFront:
    """Bind and start the HTTP front; OSError naming --http-port when the port is taken."""
    assert http.http_port is not None
    token = (
        read_token_file(server_config.auth_token_file)
        if server_config.auth_token_file is not None
        else None
    )
    app = build_app(engine, limits, http, token)
    family = socket.AF_INET6 if ":" in server_config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((server_config.host.strip("[]"), http.http_port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot bind {format_address(server_config.host, http.http_port)} (--http-port): {exc}"
        ) from exc
    tls: dict[str, object] = {}
    if server_config.tls:
        tls = dict(ssl_certfile=server_config.tls_cert, ssl_keyfile=server_config.tls_key)
        if server_config.tls_client_ca:
            tls.update(ssl_ca_certs=server_config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(server_config.grace_s)),
        **tls,  # type: ignore[arg-type]
    )
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="http-front")
    deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()
            raise OSError("the HTTP front stopped during start-up; see the log above")
        if asyncio.get_running_loop().time() > deadline:
            raise OSError("the HTTP front did not start in time")
        await asyncio.sleep(0.01)
    port = sock.getsockname()[1]
    scheme = "https" if server_config.tls else "http"
    log.info(
        "OpenAI-compatible HTTP API on %s://%s/v1",
        scheme,
        format_address(server_config.host, port),
        extra={"http_port": port},
    )
    return HttpFront(server, task, port, sock)


def http_companion(
    engine: ServingEngine | ServingRewardModel | None,
    limits: InferenceServiceConfig,
    http: HttpConfig,
) -> Callable[[ServerConfig], Awaitable[Companion]] | None:
    """The binding's companion starting the HTTP front, or None without --http-port."""
    if http.http_port is None:
        return None

    async def start(server_config: ServerConfig) -> Companion:
        return await start_http(engine, limits, http, server_config)

    return start
