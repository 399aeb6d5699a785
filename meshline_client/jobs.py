"""JobsClient: start a long operation (preprocess, train, convert, evaluate) and watch it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.message import Message

from meshline.common.v1 import operations_pb2 as ops
from meshline.common.v1 import operations_pb2_grpc as ops_grpc
from meshline.converter.v1 import converter_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2_grpc
from meshline.trainer.v1 import trainer_pb2_grpc
from meshline_client.connection import Connection

# Start RPC of each service: (stub class, method name).
STARTS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "preprocess": (preprocess_pb2_grpc.PreprocessServiceStub, "StartPreprocess"),
    "train": (trainer_pb2_grpc.TrainerServiceStub, "StartTraining"),
    "convert": (converter_pb2_grpc.ConverterServiceStub, "Convert"),
    "evaluate": (evaluator_pb2_grpc.EvaluatorServiceStub, "StartEvaluation"),
}


class JobFailed(RuntimeError):
    """A watched operation ended FAILED or CANCELLED; `operation` is its last state."""

    def __init__(self, operation: ops.Operation) -> None:
        state = ops.OperationState.Name(operation.state)
        super().__init__(f"{operation.name} ended {state}: {operation.error.message}")
        self.operation = operation


class JobsClient:
    """Starts jobs on one job server and follows them through its OperationsService."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._channel = connection.channel()
        self._operations = ops_grpc.OperationsServiceStub(self._channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> JobsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self, kind: str, request: Message, *, timeout_s: float | None = None
    ) -> ops.Operation:
        """Start a job: `kind` is preprocess, train, convert or evaluate; `request` that
        service's Start request message. Returns the new operation."""
        if kind not in STARTS:
            raise ValueError(f"kind must be one of {sorted(STARTS)}, got {kind!r}")
        stub_class, method = STARTS[kind]
        call = getattr(stub_class(self._channel), method)
        timeout = self.connection.timeout_s if timeout_s is None else timeout_s
        return call(request, timeout=timeout).operation

    def get(self, name: str) -> ops.Operation:
        """Latest state of an operation."""
        request = ops.GetOperationRequest(name=name)
        return self._operations.GetOperation(request, timeout=self.connection.timeout_s).operation

    def cancel(self, name: str) -> ops.Operation:
        """Ask an operation to stop (idempotent)."""
        request = ops.CancelOperationRequest(name=name)
        return self._operations.CancelOperation(
            request, timeout=self.connection.timeout_s
        ).operation

    def watch(self, name: str, *, timeout_s: float | None = None) -> Iterator[ops.Operation]:
        """Each change of the operation until it finishes (`timeout_s`: the whole watch)."""
        call = self._operations.WatchOperation(
            ops.WatchOperationRequest(name=name), timeout=timeout_s
        )
        try:
            for message in call:
                yield message.operation
        finally:
            call.cancel()

    def wait(self, name: str, *, timeout_s: float | None = None) -> ops.Operation:
        """Block until the operation finishes; JobFailed unless it SUCCEEDED."""
        last = None
        for change in self.watch(name, timeout_s=timeout_s):
            last = change
        if last is None or not last.done:
            last = self.get(name)
        if last.state != ops.OPERATION_STATE_SUCCEEDED:
            raise JobFailed(last)
        return last

    def run(
        self,
        kind: str,
        request: Message,
        *,
        timeout_s: float | None = None,
        on_progress: Callable[[ops.Operation], None] | None = None,
    ) -> ops.Operation:
        """Start a job and follow it to the end (calling `on_progress` on every change)."""
        operation = self.start(kind, request)
        for change in self.watch(operation.name, timeout_s=timeout_s):
            operation = change
            if on_progress is not None:
                on_progress(change)
        if operation.state != ops.OPERATION_STATE_SUCCEEDED:
            raise JobFailed(operation)
        return operation
