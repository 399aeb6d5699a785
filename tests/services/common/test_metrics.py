"""The gRPC metrics interceptor on a real server: calls counted by method and final status
(including auth and load refusals the guard answers), streams timed, --metrics-port checked."""

from __future__ import annotations

import grpc
import pytest
import requests
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import ServerConfig
from services.common.metrics import start_metrics_server
from services.common.server import create_server
from tests.services.common.helpers import PROBE_SERVICE, ProbeServicer, arun, probe_binding


def _count(method: str, code: str) -> float:
    value = REGISTRY.get_sample_value(
        "meshline_grpc_requests_total",
        {"service": PROBE_SERVICE, "method": method, "code": code},
    )
    return value or 0.0


def test_calls_are_counted_by_method_and_code(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken")

    async def body() -> dict[tuple[str, str], float]:
        before = {
            key: _count(*key)
            for key in [
                ("Echo", "OK"),
                ("Invalid", "INVALID_ARGUMENT"),
                ("Crash", "INTERNAL"),
                ("StreamThenInvalid", "INVALID_ARGUMENT"),
                ("Echo", "UNAUTHENTICATED"),
            ]
        }
        server, port, _ = await create_server(
            [probe_binding(ProbeServicer())], ServerConfig(auth_token_file=str(token))
        )
        auth = (("authorization", "Bearer t0ken"),)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert await channel.unary_unary(f"/{PROBE_SERVICE}/Echo")(b"x", metadata=auth)
                for method in ("Invalid", "Crash"):
                    with pytest.raises(grpc.aio.AioRpcError):
                        await channel.unary_unary(f"/{PROBE_SERVICE}/{method}")(b"", metadata=auth)
                call = channel.unary_stream(f"/{PROBE_SERVICE}/StreamThenInvalid")(
                    b"", metadata=auth
                )
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in call:
                        pass
                with pytest.raises(grpc.aio.AioRpcError):
                    await channel.unary_unary(f"/{PROBE_SERVICE}/Echo")(b"x")
        finally:
            await server.stop(0)
        return {key: _count(*key) - value for key, value in before.items()}

    moved = arun(body())
    assert moved == {
        ("Echo", "OK"): 1,
        ("Invalid", "INVALID_ARGUMENT"): 1,
        ("Crash", "INTERNAL"): 1,
        ("StreamThenInvalid", "INVALID_ARGUMENT"): 1,
        ("Echo", "UNAUTHENTICATED"): 1,
    }
    latency = REGISTRY.get_sample_value(
        "meshline_grpc_request_duration_seconds_count",
        {"service": PROBE_SERVICE, "method": "Crash"},
    )
    assert latency and latency >= 1


def test_metrics_server_serves_the_text_format() -> None:
    server = start_metrics_server("127.0.0.1", 0)
    try:
        text = requests.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).text
        names = {family.name for family in text_string_to_metric_families(text)}
        assert {"meshline_grpc_requests", "meshline_operations"} <= names
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_port_is_validated() -> None:
    with pytest.raises(ValueError, match="--metrics-port"):
        ServerConfig(metrics_port=70000)
    assert ServerConfig(metrics_port=0).metrics_port == 0


def test_serve_all_gives_each_child_its_metrics_port() -> None:
    from services.serve import _all_parser, child_commands

    args = _all_parser().parse_args(["--base-port", "6000", "--metrics-base-port", "9100"])
    commands = child_commands(args)
    ports = [int(c[c.index("--metrics-port") + 1]) for c in commands.values()]
    assert ports == list(range(9100, 9100 + len(commands)))
    assert all(
        "--metrics-port" not in c for c in child_commands(_all_parser().parse_args([])).values()
    )


def test_a_call_the_client_cancels_counts_as_cancelled() -> None:
    import asyncio

    async def body() -> float:
        before = _count("Block", "CANCELLED")
        probe = ProbeServicer()
        server, port, _ = await create_server([probe_binding(probe)], ServerConfig())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary(f"/{PROBE_SERVICE}/Block")(b"")
                while probe.entered == 0:
                    await asyncio.sleep(0.01)
                call.cancel()
                for _ in range(500):
                    if _count("Block", "CANCELLED") > before:
                        break
                    await asyncio.sleep(0.01)
        finally:
            await server.stop(0)
        return _count("Block", "CANCELLED") - before

    assert arun(body()) == 1
