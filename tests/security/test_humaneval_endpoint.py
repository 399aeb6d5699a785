"""StartEvaluation(humaneval) on a real evaluator against an endpoint returning hostile code.

The completion forges every verdict signal the old single-process sandbox trusted (it prints
"passed" and then each 32-character string of its frames - the old bootstrap's success nonce
among them - and exits 0 before the tests through the bootstrap's own saved `os._exit`:
pass@1 = 1.0 on the old sandbox); the score must
be 0, while the same server scores 1 for the right answers. Without isolation the server
refuses up front (FAILED_PRECONDITION naming --allow-unsafe-code-execution, nothing generated)
unless its operator allowed unsafe execution. A load_format that is not a served
CheckpointFormat (DEEPSPEED, or out of the enum) is INVALID_ARGUMENT.
"""

from __future__ import annotations

import json

import grpc
import pytest

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from services.common.operations import OperationsStore
from services.evaluator.config import EvaluatorServiceConfig
from services.evaluator.sandbox.runner import ISOLATION_ENV, UNSAFE_FLAG, isolation
from services.evaluator.servicer import bindings
from tests.security.fake_inference import serve_fake
from tests.services.evaluator.lm_eval_ref import FIXTURES
from tests.services.evaluator.servers import ServerThread

FORGER = (
    "    return None\n"
    "import os, sys\n"
    "print('passed')\n"
    "leave = os._exit\n"
    "frame = sys._getframe()\n"
    "while frame is not None:\n"
    "    for name, value in [*frame.f_locals.items(), *frame.f_globals.items()]:\n"
    "        if isinstance(value, str) and len(value) == 32:\n"
    "            print('\\n' + value)\n"
    "        if name == 'exit_now':\n"
    "            leave = value\n"
    "    frame = frame.f_back\n"
    "sys.stdout.flush()\n"
    "leave(0)\n"
)
PROBLEMS = [json.loads(line) for line in (FIXTURES / "humaneval" / "HumanEval.jsonl").open()]
CANONICAL = {doc["prompt"]: doc["canonical_solution"] for doc in PROBLEMS}


def _evaluate(tmp_path, answer, *, allow_unsafe=False):
    """pass@1 of StartEvaluation(humaneval) against a fake endpoint, or the RpcError."""
    tmp_path.mkdir(exist_ok=True)
    inference, fake = serve_fake(answer)
    config = EvaluatorServiceConfig(
        data_roots=(tmp_path, FIXTURES), allow_unsafe_code_execution=allow_unsafe
    )
    server = ServerThread(bindings(config, OperationsStore(None)))
    channel = grpc.insecure_channel(server.address)
    try:
        stub = evaluator_pb2_grpc.EvaluatorServiceStub(channel)
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        request = evaluator_pb2.StartEvaluationRequest(
            tasks=["humaneval"], task_data_path=str(FIXTURES), endpoint=inference.address,
            output_path=str(tmp_path / "out"),
        )  # fmt: skip
        try:
            started = stub.StartEvaluation(request).operation
        except grpc.RpcError as err:
            return err, fake
        done = ops.WaitOperation(
            operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=300)
        ).operation
        assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
        result = stub.GetEvaluationResult(
            evaluator_pb2.GetEvaluationResultRequest(name=started.name)
        ).result
        (row,) = result.results
        return {m.name: m.value for m in row.metrics}["pass@1"], fake
    finally:
        channel.close()
        server.stop()
        inference.stop()


@pytest.mark.skipif(not isolation().available, reason=f"no namespaces: {isolation().reason}")
def test_forging_endpoint_scores_zero_and_honest_one_scores_one(tmp_path):
    hostile, fake = _evaluate(tmp_path / "a", lambda prompt: FORGER)
    assert fake.generated == len(PROBLEMS)
    assert hostile == 0.0
    honest, _ = _evaluate(tmp_path / "b", lambda prompt: CANONICAL[prompt])
    assert honest == 1.0


def test_without_isolation_the_server_refuses_before_generating(tmp_path, monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "off")
    err, fake = _evaluate(tmp_path, lambda prompt: FORGER)
    assert isinstance(err, grpc.RpcError)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert UNSAFE_FLAG in err.details() and "namespaces" in err.details()
    assert fake.generated == 0


def test_without_isolation_an_operator_may_allow_unsafe_runs(tmp_path, monkeypatch):
    """Still a verdict the completion cannot forge: the test runs in a process of its own."""
    monkeypatch.setenv(ISOLATION_ENV, "off")
    hostile, fake = _evaluate(tmp_path / "a", lambda prompt: FORGER, allow_unsafe=True)
    assert (hostile, fake.generated) == (0.0, len(PROBLEMS))
    honest, _ = _evaluate(tmp_path / "b", lambda prompt: CANONICAL[prompt], allow_unsafe=True)
    assert honest == 1.0


@pytest.mark.parametrize("load_format", [4, 99, -1, 2**31 - 1])
def test_load_format_outside_the_enum_is_invalid_argument(tmp_path, load_format):
    config = EvaluatorServiceConfig(data_roots=(tmp_path,))
    server = ServerThread(bindings(config, OperationsStore(None)))
    channel = grpc.insecure_channel(server.address)
    request = evaluator_pb2.StartEvaluationRequest(tasks=["boolq"], task_data_path=str(tmp_path))
    request.local.load_dir = str(tmp_path)
    request.local.load_format = load_format
    try:
        with pytest.raises(grpc.RpcError) as caught:
            evaluator_pb2_grpc.EvaluatorServiceStub(channel).StartEvaluation(request)
    finally:
        channel.close()
        server.stop()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "local.load_format" in caught.value.details()
    assert str(load_format) in caught.value.details()
