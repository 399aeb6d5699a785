"""A Convert call against a real ConverterService on localhost (port 0), confined to one root."""

from __future__ import annotations

from pathlib import Path

import grpc

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.converter.v1 import converter_pb2, converter_pb2_grpc
from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import create_server
from services.converter.config import ConverterServiceConfig
from services.converter.servicer import bindings
from tests.services.common.helpers import arun

_CODES = {code.value[0]: code for code in grpc.StatusCode}


async def _call(root: Path, request: converter_pb2.ConvertRequest) -> tuple[grpc.StatusCode, str]:
    server, port, _ = await create_server(
        bindings(ConverterServiceConfig(data_roots=(root,)), OperationsStore(None)),
        ServerConfig(port=0),
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                response = await converter_pb2_grpc.ConverterServiceStub(channel).Convert(request)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
            waited = await operations_pb2_grpc.OperationsServiceStub(channel).WaitOperation(
                operations_pb2.WaitOperationRequest(
                    name=response.operation.name, timeout_seconds=120
                )
            )
            operation = waited.operation
            if operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED:
                return grpc.StatusCode.OK, ""
            return _CODES[operation.error.code], operation.error.message
    finally:
        await server.stop(None)


def convert_over_grpc(
    root: Path, request: converter_pb2.ConvertRequest
) -> tuple[grpc.StatusCode, str]:
    """(status, message) of `request`: the RPC's own error, or its operation's final state."""
    return arun(_call(root, request), timeout=180)
