"""kill -9 the evaluator service at random points of an evaluation (fixed seed), restart it on
the same state dir, and check from outside: results.json appears only for a SUCCEEDED operation
(never a partial report), the output claim and its flock are free, the operation is in a true
final state; then the same request runs to the end."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import grpc
import pytest

from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from tests.chaos.procs import Service, db_rows, lock_is_free, start_service, wait_for
from tests.services.evaluator.lm_eval_ref import FIXTURES
from tests.services.inference.http_served import make_checkpoint

pytestmark = [pytest.mark.slow]
SEED = 37
KILLS = 2
COPIES = 150
"""The 4 fixture BoolQ questions, each in this many numbered variants (distinct requests: the
evaluator's response cache answers a repeated one at once), so an evaluation runs for seconds."""


def make_task_data(folder: Path) -> Path:
    """BoolQ data with COPIES numbered variants of each fixture validation question."""
    (folder / "boolq").mkdir(parents=True)
    shutil.copy(FIXTURES / "boolq" / "train.jsonl", folder / "boolq" / "train.jsonl")
    rows = [
        json.loads(line) for line in (FIXTURES / "boolq" / "dev.jsonl").read_text().splitlines()
    ]
    variants = [
        json.dumps({**row, "question": f"{row['question']} ({copy})"})
        for copy in range(COPIES)
        for row in rows
    ]
    (folder / "boolq" / "dev.jsonl").write_text("\n".join(variants) + "\n")
    return folder


def evaluation(load: Path, tasks: Path, output: Path) -> evaluator_pb2.StartEvaluationRequest:
    return evaluator_pb2.StartEvaluationRequest(
        tasks=["boolq"],
        task_data_path=str(tasks),
        num_fewshot=0,
        local=evaluator_pb2.LocalModel(
            load_dir=str(load), load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF
        ),
        output_path=str(output),
    )


def start(service: Service, request: evaluator_pb2.StartEvaluationRequest) -> str:
    with service.channel() as channel:
        stub = evaluator_pb2_grpc.EvaluatorServiceStub(channel)
        return stub.StartEvaluation(request, timeout=60).operation.name


def get(service: Service, name: str) -> operations_pb2.Operation:
    with service.channel() as channel:
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        return ops.GetOperation(operations_pb2.GetOperationRequest(name=name), timeout=30).operation


def kill_at_progress(service: Service, name: str, fraction: float) -> None:
    """Waits until `fraction` of the model requests are answered (or the job ended)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        operation = get(service, name)
        if operation.done:
            return
        metadata = evaluator_pb2.EvaluationMetadata()
        operation.metadata.Unpack(metadata)
        if metadata.requests_total and metadata.requests_done >= fraction * metadata.requests_total:
            return
        time.sleep(0.02)
    pytest.fail(f"the evaluation reached {fraction:.0%} of its requests within 180 s")


def test_evaluator_survives_random_kills(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, sentencepiece_model
) -> None:
    rng = random.Random(SEED)
    data, state = tmp_path / "data", tmp_path / "state"
    data.mkdir()
    checkpoint, _, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=7)
    load = Path(shutil.copytree(checkpoint, data / "model"))
    tasks = make_task_data(data / "tasks")
    output = data / "eval"
    request = evaluation(load, tasks, output)
    service = start_service("evaluator", data, state)
    mid_job = 0
    try:
        for kill in range(KILLS):
            name = start(service, request)
            kill_at_progress(service, name, rng.uniform(0.1, 0.6))
            service.kill9()
            service = start_service("evaluator", data, state)
            operation = get(service, name)
            assert operation.done, f"kill {kill}: {name} is not final after the restart"
            report = output / "results.json"
            if operation.state == operations_pb2.OPERATION_STATE_FAILED:
                mid_job += 1
                assert operation.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert not report.exists(), f"kill {kill}: a report of a killed evaluation"
            else:  # it finished just before the kill: a true SUCCEEDED with its whole report
                assert operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED
                assert report.is_file()
                report.unlink()  # the next round must write its own
            assert db_rows(state, "SELECT path, operation FROM claims") == []
            assert lock_is_free(output)
        assert mid_job, "every evaluation ended before its kill: give it more questions"
        name = start(service, request)
        wait_for(lambda: get(service, name).done, 300, "the last evaluation to end")
        final = get(service, name)
        assert final.state == operations_pb2.OPERATION_STATE_SUCCEEDED, final.error.message
        assert (output / "results.json").is_file()
    finally:
        service.stop()
