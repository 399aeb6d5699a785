"""The server skeleton on a real port: health, reflection, error mapping, limits, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from services.common.client import make_channel
from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.operations_servicer import SERVICE_NAME as OPS_SERVICE
from services.common.operations_servicer import operations_binding
from services.common.server import create_server, run, shutdown
from tests.services.common.helpers import PROBE_SERVICE, ProbeServicer, arun, probe_binding

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


def _probe(channel: grpc.aio.Channel, method: str, kind: str = "unary_unary"):
    return getattr(channel, kind)(f"/{PROBE_SERVICE}/{method}")


def test_health_and_reflection_list_every_service() -> None:
    async def scenario() -> None:
        bindings = [operations_binding(OperationsStore(None)), probe_binding(ProbeServicer())]
        server, port, _ = await create_server(bindings, ServerConfig(port=0))
        assert port > 0
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", OPS_SERVICE, PROBE_SERVICE):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND

                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                requests = [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=OPS_SERVICE),
                ]
                replies = [reply async for reply in stub.ServerReflectionInfo(iter(requests))]
                listed = {s.name for s in replies[0].list_services_response.service}
                assert listed == {OPS_SERVICE, PROBE_SERVICE, HEALTH, REFLECTION}
                files = replies[1].file_descriptor_response.file_descriptor_proto
                assert files, "reflection could not describe OperationsService"
        finally:
            await server.stop(0)

    arun(scenario())


def test_errors_map_to_specific_codes_and_server_stays_up() -> None:
    async def scenario() -> None:
        server, port, _ = await create_server([probe_binding(ProbeServicer())], ServerConfig())
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                call = _probe(channel, "Invalid")(b"")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                status = await rpc_status.aio.from_call(call)
                bad_request = error_details_pb2.BadRequest()
                assert status.details[0].Unpack(bad_request)
                violations = [(v.field, v.description) for v in bad_request.field_violations]
                assert violations == [
                    ("top_p", "must be in (0, 1], got 1.5"),
                    ("max_new_tokens", "must be >= 0, got -1"),
                ]

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _probe(channel, "Crash")(b"")
                assert err.value.code() == grpc.StatusCode.INTERNAL
                assert "RuntimeError" in err.value.details()
                assert "incident" in err.value.details()
                assert "secret internal detail" not in err.value.details()

                stream = _probe(channel, "StreamThenCrash", "unary_stream")(b"")
                assert await stream.read() == b"first"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stream.read()
                assert err.value.code() == grpc.StatusCode.INTERNAL

                stream = _probe(channel, "StreamThenInvalid", "unary_stream")(b"")
                assert await stream.read() == b"first"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stream.read()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "prompt: is empty" in err.value.details()

                assert await _probe(channel, "Echo")(b"still up") == b"still up"
        finally:
            await server.stop(0)

    arun(scenario())


def test_rich_status_readable_from_a_blocking_channel() -> None:
    async def scenario() -> None:
        server, port, _ = await create_server([probe_binding(ProbeServicer())], ServerConfig())

        def blocking_call() -> tuple[grpc.StatusCode, list[str]]:
            with make_channel(f"127.0.0.1:{port}", aio=False) as channel:
                try:
                    channel.unary_unary(f"/{PROBE_SERVICE}/Invalid")(b"", timeout=10)
                except grpc.RpcError as exc:
                    status = rpc_status.from_call(exc)
                    bad_request = error_details_pb2.BadRequest()
                    status.details[0].Unpack(bad_request)
                    return exc.code(), [v.field for v in bad_request.field_violations]
            raise AssertionError("the call should have failed")

        try:
            code, fields = await asyncio.to_thread(blocking_call)
        finally:
            await server.stop(0)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert fields == ["top_p", "max_new_tokens"]

    arun(scenario())


def test_past_max_concurrent_rpcs_resource_exhausted_but_health_answers() -> None:
    async def scenario() -> None:
        probe = ProbeServicer()
        server, port, _ = await create_server(
            [probe_binding(probe)], ServerConfig(max_concurrent_rpcs=2)
        )
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                blocked = [_probe(channel, "Block")(b"") for _ in range(2)]
                while probe.entered < 2:
                    await asyncio.sleep(0.01)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _probe(channel, "Echo")(b"x")
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-concurrent-rpcs=2" in err.value.details()
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

                probe.release.set()
                assert await asyncio.gather(*blocked) == [b"released", b"released"]
                assert await _probe(channel, "Echo")(b"x") == b"x"
        finally:
            await server.stop(0)

    arun(scenario())


def test_graceful_stop_drains_in_flight_calls_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        store = OperationsStore(None)
        handle = store.create("train")
        handle.start()
        bindings = [operations_binding(store)]
        server, port, health = await create_server(bindings, ServerConfig(grace_s=10))
        address = f"127.0.0.1:{port}"
        async with make_channel(address) as channel:
            ops = operations_pb2_grpc.OperationsServiceStub(channel)
            waiting = ops.WaitOperation(operations_pb2.WaitOperationRequest(name=handle.name))
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=OPS_SERVICE)
            )
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            while not store._watchers[handle.name]:  # the Wait call has reached the store
                await asyncio.sleep(0.01)

            started = time.monotonic()
            stopping = asyncio.create_task(shutdown(server, health, bindings, 10.0))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await watch.read() == grpc.aio.EOF, "health Watch should end on shutdown"
            assert health.status("") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert handle.cancel_requested.is_set(), "stopping should ask running jobs to stop"

            async with make_channel(address) as fresh:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health_pb2_grpc.HealthStub(fresh).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=5
                    )
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            # The job finishes within the grace period: the in-flight Wait gets the final state.
            handle.succeed(operations_pb2.Progress(completed=3, unit="steps"))
            reply = await waiting
            assert reply.operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED
            await stopping
            assert time.monotonic() - started < 5, "drain should end once in-flight calls finish"

    arun(scenario())


def test_port_in_use_is_a_clear_error() -> None:
    async def scenario() -> None:
        server, port, _ = await create_server([], ServerConfig())
        try:
            with pytest.raises(OSError, match="--host/--port"):
                await create_server([], ServerConfig(port=port))
        finally:
            await server.stop(0)

    arun(scenario())


def test_run_reports_start_up_problems_as_exit_code(tmp_path) -> None:
    bad_key = tmp_path / "key.pem"
    bad_key.write_text("not a key")
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        config = ServerConfig(tls_cert=str(bad_key), tls_key=str(bad_key))
        assert run([], config) == 1
    finally:
        for handler in list(root.handlers):
            if handler not in saved[1]:
                root.removeHandler(handler)
        root.setLevel(saved[0])


SIGNAL_DURING_START = """
import dataclasses, os, signal, sys
from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.operations_servicer import operations_binding
from services.common.server import run


class Companion:
    async def stop(self, grace_s):
        print("companion stopped", flush=True)


async def start(config):
    # The port already answers health checks here: a client may send SIGTERM at this moment.
    os.kill(os.getpid(), signal.SIGTERM)
    return Companion()


binding = dataclasses.replace(operations_binding(OperationsStore(None)), companion=start)
sys.exit(run([binding], ServerConfig(port=0, grace_s=1.0)))
"""


def test_sigterm_while_the_server_starts_drains_it_with_exit_code_0() -> None:
    """A SIGTERM that lands once the port answers but before start-up ends stops the server
    gracefully (exit 0), not by the default action (-15): CI once saw a trainer killed so."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_DURING_START],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "SIGTERM received" in output and "companion stopped" in output, output
    assert "stopped serving" in output, output
