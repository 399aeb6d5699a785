"""EvaluatorService over gRPC on port 0: StartEvaluation runs as an operation with progress and
a typed result, ListTasks lists the registry, bad requests get the right status codes."""

from __future__ import annotations

import json

import grpc
import pytest

from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from services.common.operations import OperationsStore
from services.evaluator.config import EvaluatorServiceConfig
from services.evaluator.sandbox.runner import isolation
from services.evaluator.servicer import bindings
from tests.services.evaluator.lm_eval_ref import FIXTURES
from tests.services.evaluator.servers import ServerThread


@pytest.fixture
def evaluator(tmp_path):
    # The tiny model's HumanEval completions are the tests' own: where the host has no
    # namespaces, the server runs them in unsafe mode instead of refusing (tests/security).
    config = EvaluatorServiceConfig(
        data_roots=(tmp_path, FIXTURES), allow_unsafe_code_execution=not isolation().available
    )
    server = ServerThread(bindings(config, OperationsStore(None)))
    channel = grpc.insecure_channel(server.address)
    yield (
        evaluator_pb2_grpc.EvaluatorServiceStub(channel),
        operations_pb2_grpc.OperationsServiceStub(channel),
        tmp_path,
    )
    channel.close()
    server.stop()


def test_evaluation_runs_as_an_operation(served, evaluator):
    _, inference = served
    stub, ops, root = evaluator
    request = evaluator_pb2.StartEvaluationRequest(
        tasks=["mmlu", "gsm8k_cot"],
        task_data_path=str(FIXTURES),
        endpoint=inference.address,
        limit=2,
        max_new_tokens=8,
        batch_size=4,
        output_path=str(root / "out"),
    )
    started = stub.StartEvaluation(request).operation
    assert started.kind == "evaluate"
    done = ops.WaitOperation(
        operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=300)
    ).operation
    assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
    metadata = evaluator_pb2.EvaluationMetadata()
    assert done.metadata.Unpack(metadata)
    assert metadata.requests_done == metadata.requests_total == 4 * 4 + 2
    assert metadata.tasks_done == metadata.tasks_total == 3  # the 2 MMLU subjects with data
    result = stub.GetEvaluationResult(
        evaluator_pb2.GetEvaluationResultRequest(name=started.name)
    ).result
    rows = {r.task: r for r in result.results}
    assert set(rows) == {"mmlu_anatomy", "mmlu_astronomy", "gsm8k_cot", "mmlu", "mmlu_stem"}
    assert rows["mmlu"].group == "mmlu" and rows["mmlu_anatomy"].group == "mmlu"
    assert rows["mmlu_anatomy"].num_fewshot == 5 and rows["mmlu_anatomy"].num_samples == 2
    assert {(m.name, m.filter) for m in rows["gsm8k_cot"].metrics} == {
        ("exact_match", "strict-match"),
        ("exact_match", "flexible-extract"),
    }
    with open(result.results_path) as fh:
        document = json.load(fh)
    assert document["results"]["mmlu_anatomy"]["acc,none"] == pytest.approx(
        next(m.value for m in rows["mmlu_anatomy"].metrics if m.name == "acc")
    )
    assert result.model == inference.address


def test_list_tasks_and_unknown_names(evaluator):
    stub, _, _ = evaluator
    tasks = {t.name: t for t in stub.ListTasks(evaluator_pb2.ListTasksRequest()).tasks}
    assert len(tasks["mmlu"].subtasks) == 57
    assert tasks["gsm8k_cot"].default_num_fewshot == 8 and tasks["gsm8k"].default_num_fewshot == 5
    assert len(tasks["agieval"].subtasks) == 21 and list(tasks["agieval"].metrics) == ["acc"]
    assert tasks["agieval"].description.endswith("(generate_until and multiple_choice)")
    assert (
        list(tasks["mmlu"].metrics) == ["acc"] and tasks["mmlu"].description == "group of 57 tasks"
    )
    assert tasks["agieval_math"].output_type == "generate_until"
    assert list(tasks["agieval_gaokao_mathcloze"].metrics) == ["acc"]
    assert tasks["humaneval"].output_type == "generate_until"
    assert list(tasks["boolq"].metrics) == ["acc"]
    with pytest.raises(grpc.RpcError) as err:
        stub.StartEvaluation(
            evaluator_pb2.StartEvaluationRequest(
                tasks=["mmlu_klingon"], task_data_path=str(FIXTURES), endpoint="127.0.0.1:1"
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert "mmlu_klingon" in details and "known groups: agieval, bbh, ceval-valid, mmlu" in details
    assert "boolq, gsm8k, gsm8k_cot, humaneval" in details and "closest: mmlu_" in details
    with pytest.raises(grpc.RpcError) as err:
        stub.StartEvaluation(
            evaluator_pb2.StartEvaluationRequest(
                tasks=["agieval_maths", "gsm8"], task_data_path=str(FIXTURES), endpoint="h:1"
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "closest: agieval_math, " in err.value.details() and " gsm8k," in err.value.details()


def test_unreachable_endpoint_fails_the_operation(evaluator):
    stub, ops, root = evaluator
    started = stub.StartEvaluation(
        evaluator_pb2.StartEvaluationRequest(
            tasks=["boolq"],
            task_data_path=str(FIXTURES),
            endpoint="127.0.0.1:1",
            output_path=str(root / "x"),
        )
    ).operation
    done = ops.WaitOperation(
        operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=120)
    ).operation
    assert done.state == operations_pb2.OPERATION_STATE_FAILED
    assert done.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "127.0.0.1:1" in done.error.message
    with pytest.raises(grpc.RpcError) as err:
        stub.GetEvaluationResult(evaluator_pb2.GetEvaluationResultRequest(name=started.name))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_local_checkpoint_evaluation(served, tmp_path):
    checkpoint, _ = served
    config = EvaluatorServiceConfig(data_roots=(tmp_path, FIXTURES, checkpoint.parent))
    server = ServerThread(bindings(config, OperationsStore(None)))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = evaluator_pb2_grpc.EvaluatorServiceStub(channel)
            ops = operations_pb2_grpc.OperationsServiceStub(channel)
            started = stub.StartEvaluation(
                evaluator_pb2.StartEvaluationRequest(
                    tasks=["boolq"],
                    task_data_path=str(FIXTURES),
                    local=evaluator_pb2.LocalModel(
                        load_dir=str(checkpoint), load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF
                    ),
                    limit=2,
                )
            ).operation
            done = ops.WaitOperation(
                operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=300)
            ).operation
            assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
            result = stub.GetEvaluationResult(
                evaluator_pb2.GetEvaluationResultRequest(name=started.name)
            ).result
            assert result.model == str(checkpoint)
            # No output_path: results go to <output root>/<operation id>.
            assert result.results_path.startswith(str(tmp_path / "runs" / "eval"))
            assert started.name.rsplit("/", 1)[-1] in result.results_path
    finally:
        server.stop()


def test_humaneval_pass_at_k_from_sampled_completions(served, evaluator):
    _, inference = served
    stub, ops, root = evaluator
    started = stub.StartEvaluation(
        evaluator_pb2.StartEvaluationRequest(
            tasks=["humaneval"],
            task_data_path=str(FIXTURES),
            endpoint=inference.address,
            limit=1,
            max_new_tokens=6,
            num_samples=3,
            temperature=0.5,
            output_path=str(root / "humaneval"),
        )
    ).operation
    done = ops.WaitOperation(
        operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=300)
    ).operation
    assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
    metadata = evaluator_pb2.EvaluationMetadata()
    assert done.metadata.Unpack(metadata)
    assert metadata.requests_done == metadata.requests_total == 3
    assert metadata.request.num_samples == 3
    result = stub.GetEvaluationResult(
        evaluator_pb2.GetEvaluationResultRequest(name=started.name)
    ).result
    (row,) = result.results
    assert {(m.name, m.filter) for m in row.metrics} == {
        ("pass@1", "create_test"),
        ("pass@3", "create_test"),
    }
    document = json.loads((root / "humaneval" / "results.json").read_text())
    assert document["config"]["num_samples"] == 3
    assert document["config"]["temperature"] == pytest.approx(0.5)
    (sample,) = map(json.loads, (root / "humaneval" / "samples_humaneval.jsonl").open())
    assert len(sample["resps"]) == 3
    kwargs = [arguments[1] for arguments in sample["arguments"]]
    assert [k["seed"] for k in kwargs] == [1234, 1235, 1236]
    assert all(k["do_sample"] and k["temperature"] == pytest.approx(0.5) for k in kwargs)
    # Of n = 3 completions c passed: pass@1 = c / 3 and pass@3 = 1 if c else 0.
    values = {m.name: m.value for m in row.metrics}
    assert values["pass@1"] in {c / 3 for c in range(4)}
    assert values["pass@3"] == float(values["pass@1"] > 0)


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"num_samples": 0}, "num_samples", "must be in [1, 200], got 0"),
        ({"num_samples": 201}, "num_samples", "got 201"),
        ({"num_samples": 4, "tasks": ["boolq"]}, "num_samples", 'add "humaneval" to tasks'),
        ({"num_samples": 4, "temperature": 0.0}, "temperature", "must be in (0, 2], got 0"),
        ({"num_samples": 4, "temperature": 2.5}, "temperature", "got 2.5"),
        ({"temperature": 0.7}, "temperature", "only applies to sampled completions"),
        ({"num_samples": 1, "temperature": 0.7}, "temperature", "num_samples > 1"),
    ],
)
def test_sampling_fields_are_validated(evaluator, fields, field, reason):
    stub, _, _ = evaluator
    request = evaluator_pb2.StartEvaluationRequest(
        tasks=fields.pop("tasks", ["humaneval"]),
        task_data_path=str(FIXTURES),
        endpoint="127.0.0.1:1",
        **fields,
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.StartEvaluation(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details() and reason in err.value.details()
