"""Fixtures of the path and trainer cases (a data root, a place outside it, a trainer server),
imported by their test modules; kept out of conftest.py so other corpus files stay independent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from services.common.operations import OperationsStore
from services.trainer import servicer as trainer_servicer
from services.trainer.config import TrainerServiceConfig
from tests.services.evaluator.servers import ServerThread


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The data root a server is confined to."""
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the root that a hostile request tries to reach."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


@pytest.fixture
def trainer_server(root: Path) -> Iterator[ServerThread]:
    """A real TrainerService (local torchrun launcher) on 127.0.0.1:<port 0>, confined to root."""
    config = TrainerServiceConfig(data_roots=(root,), launcher="local")
    server = ServerThread(trainer_servicer.bindings(config, OperationsStore(None)))
    try:
        yield server
    finally:
        server.stop()


def list_operations(address: str) -> list[operations_pb2.Operation]:
    """Every operation the server at `address` holds (a refused request must have made none)."""
    with grpc.insecure_channel(address) as channel:
        stub = operations_pb2_grpc.OperationsServiceStub(channel)
        return list(stub.ListOperations(operations_pb2.ListOperationsRequest()).operations)


def wait_operation(address: str, name: str, timeout: float = 240) -> operations_pb2.Operation:
    """The finished operation `name` (fails the test if it is still running after `timeout`)."""
    with grpc.insecure_channel(address) as channel:
        stub = operations_pb2_grpc.OperationsServiceStub(channel)
        request = operations_pb2.WaitOperationRequest(name=name, timeout_seconds=timeout)
        operation = stub.WaitOperation(request, timeout=timeout + 30).operation
    assert operation.done, f"{name} still running after {timeout}s"
    return operation
