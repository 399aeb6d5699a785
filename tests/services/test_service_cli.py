"""Every service starts from its CLI in a real subprocess and behaves like a Meshline server.

Each of the five `python -m services.<name> serve --port 0` processes (started in parallel) logs
its bound port, answers health (SERVING) and reflection over a real channel, rejects a malformed
request with INVALID_ARGUMENT naming the field, and exits 0 on SIGTERM. `meshline serve all` brings
up all five on consecutive ports and stops them all cleanly on Ctrl-C.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
from meshline.converter.v1 import converter_pb2, converter_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2, preprocess_pb2_grpc
from meshline.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from models.tokenizer import build_tokenizer, train_sentencepiece
from tokendata.indexed import IndexedDataset

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("preprocess", "trainer", "converter", "inference", "evaluator")
SERVICE_NAMES = {
    "preprocess": "meshline.preprocess.v1.PreprocessService",
    "trainer": "meshline.trainer.v1.TrainerService",
    "converter": "meshline.converter.v1.ConverterService",
    "inference": "meshline.inference.v1.InferenceService",
    "evaluator": "meshline.evaluator.v1.EvaluatorService",
}
OPERATIONS = "meshline.common.v1.OperationsService"
SERVING_LINE = re.compile(r"serving (?P<names>.+) on (?P<host>\S+):(?P<port>\d+)")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


@dataclass
class ServerProcess:
    """A service started from its CLI, with its log lines collected by a reader thread."""

    name: str
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    eof: threading.Event = field(default_factory=threading.Event)
    port: int = 0

    def read(self) -> None:
        """Drains the child's output so it never blocks on a full pipe; notes the port line."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            match = SERVING_LINE.search(line)
            if match and not self.ready.is_set():
                self.port = int(match["port"])
                self.ready.set()
        self.ready.set()
        self.eof.set()

    def log(self) -> str:
        return "\n".join(self.lines[-30:])


def _spawn(command: list[str], name: str, *, new_session: bool = False) -> ServerProcess:
    process = subprocess.Popen(
        command,
        start_new_session=new_session,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    server = ServerProcess(name, process)
    threading.Thread(target=server.read, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-root")


@pytest.fixture(scope="module")
def servers(data_root: Path) -> Iterator[dict[str, ServerProcess]]:
    started = {}
    for name in SERVICES:
        command = [sys.executable, "-m", f"services.{name}", "serve", "--port", "0"]
        command += ["--grace-period", "5"]
        if name != "inference":
            command += ["--data-root", str(data_root)]
        started[name] = _spawn(command, name)
    try:
        for server in started.values():
            assert server.ready.wait(START_TIMEOUT_S), f"{server.name} never logged its port"
            assert server.port, f"{server.name} exited before serving:\n{server.log()}"
        yield started
    finally:
        for server in started.values():
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()


def _channel(port: int) -> grpc.Channel:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel


def _health(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return {service.name for service in response.list_services_response.service}


def _reflected_file(channel: grpc.Channel, symbol: str) -> list[bytes]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    assert not response.HasField("error_response"), response.error_response.error_message
    return list(response.file_descriptor_response.file_descriptor_proto)


def _violated_fields(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)
    assert status is not None, "INVALID_ARGUMENT came without rich status details"
    fields = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            fields += [violation.field for violation in bad_request.field_violations]
    return fields


def _invalid_call(name: str, channel: grpc.Channel, data_root: Path) -> tuple[object, str]:
    """One malformed request per service and the field it must be rejected for."""
    if name == "preprocess":
        request = preprocess_pb2.StartPreprocessRequest(
            input=[str(data_root / "corpus.jsonl")],
            output_prefix="",
            tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
            tokenizer_model=str(data_root / "tok.model"),
        )
        call = preprocess_pb2_grpc.PreprocessServiceStub(channel).StartPreprocess
        return (lambda: call(request, timeout=10)), "output_prefix"
    if name == "trainer":
        request = trainer_pb2.StartTrainingRequest(args=["--train-iters", "10"], nproc_per_node=0)
        call = trainer_pb2_grpc.TrainerServiceStub(channel).StartTraining
        return (lambda: call(request, timeout=10)), "nproc_per_node"
    if name == "converter":
        request = converter_pb2.ConvertRequest(
            load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF,
            save_format=checkpoint_pb2.CHECKPOINT_FORMAT_MEGATRON,
            load_dir=str(data_root / "hf"),
            save_dir=str(data_root / "megatron"),
            target_tensor_parallel_size=0,
        )
        call = converter_pb2_grpc.ConverterServiceStub(channel).Convert
        return (lambda: call(request, timeout=10)), "target_tensor_parallel_size"
    if name == "inference":
        request = inference_pb2.GenerateRequest(prompt="hello", prompt_token_ids=[1, 2])
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate
        return (lambda: call(request, timeout=10)), "prompt"
    request = evaluator_pb2.StartEvaluationRequest(
        tasks=["boolq"], task_data_path=str(data_root), endpoint="no-port-here"
    )
    call = evaluator_pb2_grpc.EvaluatorServiceStub(channel).StartEvaluation
    return (lambda: call(request, timeout=10)), "endpoint"


@pytest.mark.parametrize("name", SERVICES)
def test_service_serves_health_reflection_and_validation(
    name: str, servers: dict[str, ServerProcess], data_root: Path
) -> None:
    server = servers[name]
    with _channel(server.port) as channel:
        service = SERVICE_NAMES[name]
        assert _health(channel, "") == health_pb2.HealthCheckResponse.SERVING
        assert _health(channel, service) == health_pb2.HealthCheckResponse.SERVING

        listed = _reflected_services(channel)
        assert service in listed and "grpc.health.v1.Health" in listed
        assert (OPERATIONS in listed) == (name != "inference")
        assert _reflected_file(channel, service), f"reflection has no descriptor for {service}"

        call, field_name = _invalid_call(name, channel, data_root)
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert field_name in _violated_fields(caught.value)
        assert field_name in caught.value.details()
        # The server is still up after rejecting the request.
        assert _health(channel, service) == health_pb2.HealthCheckResponse.SERVING


def test_path_outside_data_root_is_permission_denied(
    servers: dict[str, ServerProcess], data_root: Path
) -> None:
    request = converter_pb2.ConvertRequest(
        load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF,
        save_format=checkpoint_pb2.CHECKPOINT_FORMAT_NATIVE,
        load_dir=str(data_root / ".." / "elsewhere"),
        save_dir=str(data_root / "out"),
    )
    with _channel(servers["converter"].port) as channel:
        stub = converter_pb2_grpc.ConverterServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Convert(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "load_dir" in caught.value.details()


def test_inference_without_model_is_failed_precondition(servers: dict[str, ServerProcess]) -> None:
    with _channel(servers["inference"].port) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--load" in caught.value.details()


# (service, RPC, request fields, status, what the error must name). Paths are under the data root
# unless the case is about leaving it.
CASES = [
    (
        "inference",
        "Generate",
        {"prompt": "hi", "params": {"top_p": 1.5}},
        "INVALID_ARGUMENT",
        "params.top_p",
    ),
    (
        "inference",
        "Generate",
        {"prompt": "hi", "params": {"temperature": -0.5}},
        "INVALID_ARGUMENT",
        "params.temperature",
    ),
    ("inference", "Generate", {"params": {"max_new_tokens": 4}}, "INVALID_ARGUMENT", "prompt"),
    (
        "inference",
        "Generate",
        {"prompt": "hi", "params": {"num_return_sequences": 2}},
        "INVALID_ARGUMENT",
        "params.num_return_sequences",
    ),
    (
        "inference",
        "Generate",
        {"prompt": "hi", "params": {"num_beams": 2, "num_return_sequences": 3}},
        "INVALID_ARGUMENT",
        "params.num_return_sequences",
    ),
    (
        "inference",
        "Generate",
        {"prompt": "hi", "params": {"stop": [""]}},
        "INVALID_ARGUMENT",
        "params.stop",
    ),
    (
        "inference",
        "Generate",
        {"prompt": "hi", "params": {"max_new_tokens": 4}},
        "FAILED_PRECONDITION",
        "--load",
    ),
    ("inference", "Score", {}, "INVALID_ARGUMENT", "items"),
    (
        "inference",
        "Score",
        {"items": [{"context": "a", "continuation": "b"}, {"context": "a"}]},
        "INVALID_ARGUMENT",
        "items[1].continuation",
    ),
    (
        "inference",
        "Score",
        {"items": [{"context": "a", "context_token_ids": [1], "continuation": "b"}]},
        "INVALID_ARGUMENT",
        "items[0].context",
    ),
    ("inference", "Tokenize", {"text": "hello"}, "FAILED_PRECONDITION", "--load"),
    (
        "converter",
        "Convert",
        {"load_format": 1, "save_format": 1, "load_dir": "{root}/a", "save_dir": "{root}/b"},
        "INVALID_ARGUMENT",
        "save_format",
    ),
    (
        "converter",
        "Convert",
        {
            "load_format": 1,
            "save_format": 2,
            "load_dir": "{root}/a",
            "save_dir": "{root}/b",
            "merge_lora": True,
        },
        "INVALID_ARGUMENT",
        "merge_lora",
    ),
    (
        "converter",
        "Convert",
        {
            "load_format": 1,
            "save_format": 2,
            "load_dir": "{root}/a",
            "save_dir": "{root}/b",
            "target_tensor_parallel_size": 2,
        },
        "INVALID_ARGUMENT",
        "target_tensor_parallel_size",
    ),
    (
        "converter",
        "Convert",
        {"load_format": 1, "save_format": 2, "load_dir": "{root}/missing", "save_dir": "{root}/b"},
        "NOT_FOUND",
        "load_dir",
    ),
    (
        "converter",
        "Convert",
        {"load_format": 1, "save_format": 2, "load_dir": "{root}", "save_dir": "{root}/inside"},
        "INVALID_ARGUMENT",
        "save_dir",
    ),
    (
        "evaluator",
        "StartEvaluation",
        {"task_data_path": "{root}", "endpoint": "localhost:50054"},
        "INVALID_ARGUMENT",
        "tasks",
    ),
    (
        "evaluator",
        "StartEvaluation",
        {"tasks": ["boolq"], "task_data_path": "{root}"},
        "INVALID_ARGUMENT",
        "model",
    ),
    (
        "evaluator",
        "StartEvaluation",
        {"tasks": ["boolq"], "task_data_path": "{root}/missing", "endpoint": "localhost:50054"},
        "NOT_FOUND",
        "task_data_path",
    ),
    (
        "evaluator",
        "StartEvaluation",
        {"tasks": ["boolq"], "task_data_path": "/", "endpoint": "localhost:50054"},
        "PERMISSION_DENIED",
        "task_data_path",
    ),
    (
        "evaluator",
        "GetEvaluationResult",
        {"name": "operations/evaluate-0123456789ab"},
        "NOT_FOUND",
        "operations/evaluate-0123456789ab",
    ),
    (
        "trainer",
        "StartTraining",
        {"args": ["--nproc-per-node", "2"]},
        "INVALID_ARGUMENT",
        "args[0]",
    ),
    (
        "trainer",
        "StartTraining",
        {"args": ["--mock-data"], "env": {"RANK": "3"}},
        "INVALID_ARGUMENT",
        "env[RANK]",
    ),
    (
        "trainer",
        "StartTraining",
        {"args": ["--mock-data"], "run_name": "Bad Name"},
        "INVALID_ARGUMENT",
        "run_name",
    ),
    (
        "trainer",
        "StopTraining",
        {"name": "operations/train-0123456789ab"},
        "NOT_FOUND",
        "operations/train-0123456789ab",
    ),
    (
        "preprocess",
        "StartPreprocess",
        {
            "input": ["{root}/nothing-*.jsonl"],
            "output_prefix": "{root}/out",
            "tokenizer_type": 1,
            "tokenizer_model": "{root}/tok.model",
        },
        "NOT_FOUND",
        "input[0]",
    ),
    (
        "preprocess",
        "StartPreprocess",
        {
            "input": ["{root}/c.jsonl"],
            "output_prefix": "{root}/out",
            "tokenizer_type": 1,
            "tokenizer_model": "x",
            "handler_name": "os:system",
        },
        "INVALID_ARGUMENT",
        "handler_name",
    ),
    (
        "preprocess",
        "StartPreprocess",
        {
            "input": ["{root}/c.jsonl"],
            "output_prefix": "{root}/out",
            "tokenizer_type": 1,
            "tokenizer_model": "x",
            "pack": True,
        },
        "INVALID_ARGUMENT",
        "seq_length",
    ),
]
STUBS = {
    "inference": (inference_pb2, inference_pb2_grpc.InferenceServiceStub),
    "converter": (converter_pb2, converter_pb2_grpc.ConverterServiceStub),
    "evaluator": (evaluator_pb2, evaluator_pb2_grpc.EvaluatorServiceStub),
    "trainer": (trainer_pb2, trainer_pb2_grpc.TrainerServiceStub),
    "preprocess": (preprocess_pb2, preprocess_pb2_grpc.PreprocessServiceStub),
}


def _fill(value: object, root: Path) -> object:
    if isinstance(value, str):
        return value.replace("{root}", str(root))
    if isinstance(value, list):
        return [_fill(v, root) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, root) for k, v in value.items()}
    return value


def test_requests_are_rejected_with_the_right_code_and_field(
    servers: dict[str, ServerProcess], data_root: Path
) -> None:
    for service, rpc, fields, code, named in CASES:
        module, stub_class = STUBS[service]
        method = module.DESCRIPTOR.services_by_name[SERVICE_NAMES[service].rsplit(".", 1)[-1]]
        request = getattr(module, method.methods_by_name[rpc].input_type.name)()
        json_format.ParseDict(_fill(fields, data_root), request)
        with _channel(servers[service].port) as channel, pytest.raises(grpc.RpcError) as caught:
            getattr(stub_class(channel), rpc)(request, timeout=30)
        case = f"{service}.{rpc}({fields})"
        assert caught.value.code().name == code, f"{case}: {caught.value.details()}"
        assert named in caught.value.details(), f"{case}: {caught.value.details()}"
        if code == "INVALID_ARGUMENT":
            assert named in _violated_fields(caught.value), case


def test_inference_with_an_empty_load_dir_fails_at_start(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    result = subprocess.run(
        [*command, "--load", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "--load" in result.stderr and str(tmp_path) in result.stderr


def _corpus(data_root: Path) -> tuple[list[str], Path, Path]:
    """A small JSONL corpus and a sentencepiece model trained on it, under the data root."""
    words = [
        "pipeline",
        "tensor",
        "shard",
        "token",
        "model",
        "gradient",
        "layer",
        "batch",
        "server",
        "checkpoint",
    ]
    texts = [
        " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 11)) + f" doc {i}."
        for i in range(60)
    ]
    corpus = data_root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    plain = data_root / "corpus.txt"
    plain.write_text("\n".join(texts) + "\n")
    model = train_sentencepiece([plain], data_root / "tok", vocab_size=300)
    return texts, corpus, model


def test_preprocess_server_runs_a_real_job(
    servers: dict[str, ServerProcess], data_root: Path
) -> None:
    texts, corpus, model = _corpus(data_root)
    (data_root / "shards").mkdir()
    request = preprocess_pb2.StartPreprocessRequest(
        input=[str(corpus)],
        output_prefix=str(data_root / "shards" / "corpus"),
        tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
        tokenizer_model=str(model),
        json_keys=["text"],
        append_eod=True,
    )
    with _channel(servers["preprocess"].port) as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        started = stub.StartPreprocess(request, timeout=30).operation
        assert started.kind == "preprocess" and started.name.startswith("operations/preprocess-")
        wait = operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=90)
        operations = operations_pb2_grpc.OperationsServiceStub(channel)
        done = operations.WaitOperation(wait, timeout=120).operation
        assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message

        result = preprocess_pb2.PreprocessResult()
        assert done.response.Unpack(result)
        metadata = preprocess_pb2.PreprocessMetadata()
        assert done.metadata.Unpack(metadata)
        assert metadata.request == request
        assert result.documents == len(texts) and Path(result.manifest_path).is_file()
        (shard,) = result.outputs
        assert shard.json_key == "text" and shard.documents == len(texts)

        tokenizer = build_tokenizer("SentencePiece", model)
        dataset = IndexedDataset(shard.path_prefix)
        assert len(dataset) == len(texts)
        for i, text in enumerate(texts):
            # A document is framed as the tokenizer frames a text (BOS first for this bare
            # sentencepiece model, as LlamaTokenizer does), then the EOD.
            framed = tokenizer.encode(text, add_special_tokens=True)
            assert list(dataset[i]) == [*framed, tokenizer.eod_id]
        assert result.tokens == shard.tokens == sum(len(dataset[i]) for i in range(len(texts)))

        # The same prefix again without overwrite: refused before anything runs.
        with pytest.raises(grpc.RpcError) as caught:
            stub.StartPreprocess(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "overwrite" in caught.value.details()


def _training_args(data_root: Path, *extra: str) -> list[str]:
    return [
        *("--model", "tiny-llama", "--mock-data", "--train-iters", "3", "--log-interval", "1"),
        *("--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "32"),
        *extra,
    ]


def test_trainer_rejects_bad_flags_and_paths_outside_the_root(
    servers: dict[str, ServerProcess], data_root: Path
) -> None:
    with _channel(servers["trainer"].port) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        bad_value = trainer_pb2.StartTrainingRequest(args=["--mock-data", "--train-iters", "abc"])
        with pytest.raises(grpc.RpcError) as caught:
            stub.StartTraining(bad_value, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--train-iters" in caught.value.details()
        assert _violated_fields(caught.value) == ["args"]

        outside = str(data_root.parent / "elsewhere" / "save")
        escape = trainer_pb2.StartTrainingRequest(args=_training_args(data_root, "--save", outside))
        with pytest.raises(grpc.RpcError) as caught:
            stub.StartTraining(escape, timeout=30)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--save" in caught.value.details()

        # A config file outside the root is refused before the parser reads it.
        config = trainer_pb2.StartTrainingRequest(args=["--config", "/etc/hostname"])
        with pytest.raises(grpc.RpcError) as caught:
            stub.StartTraining(config, timeout=30)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--config" in caught.value.details()


@pytest.mark.slow
def test_trainer_server_runs_streams_and_stops_a_real_job(
    servers: dict[str, ServerProcess], data_root: Path
) -> None:
    save, logs = data_root / "train" / "save", data_root / "train" / "logs"
    args = _training_args(data_root, "--save", str(save), "--log-dir", str(logs))
    args[args.index("--train-iters") + 1] = "500"
    with _channel(servers["trainer"].port) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        started = stub.StartTraining(trainer_pb2.StartTrainingRequest(args=args), timeout=30)
        name = started.operation.name
        # A second run saving into the same directory, spelled differently, is refused while
        # this one runs: their checkpoints and `latest` pointers would interleave.
        twin = _training_args(data_root, "--save", f"{data_root}/train/./save/")
        with pytest.raises(grpc.RpcError) as caught:
            stub.StartTraining(trainer_pb2.StartTrainingRequest(args=twin), timeout=30)
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "args (--save): another running training job (" in caught.value.details()
        assert f"({name}) writes" in caught.value.details()
        streamed = []
        for message in stub.StreamMetrics(trainer_pb2.StreamMetricsRequest(name=name), timeout=300):
            streamed.append(message)
            if len(streamed) == 2:
                stop = trainer_pb2.StopTrainingRequest(name=name)
                assert not stub.StopTraining(stop, timeout=30).operation.done
        operations = operations_pb2_grpc.OperationsServiceStub(channel)
        wait = operations_pb2.WaitOperationRequest(name=name, timeout_seconds=60)
        done = operations.WaitOperation(wait, timeout=90).operation
    assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
    last = len(streamed)
    assert 2 <= last < 500
    assert [m.step for m in streamed] == list(range(1, last + 1))
    assert all(math.isfinite(m.loss) and m.loss > 0 and m.tokens_per_s > 0 for m in streamed)
    assert [m.consumed_tokens for m in streamed] == [64 * step for step in range(1, last + 1)]

    # The stream carries exactly what the trainer wrote to metrics.csv.
    with open(logs / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [m.step for m in streamed]
    for row, message in zip(rows, streamed, strict=True):
        assert float(row["loss"]) == pytest.approx(message.loss, rel=1e-12)
        assert float(row["grad_norm"]) == pytest.approx(message.grad_norm, rel=1e-12)
        assert float(row["lr"]) == pytest.approx(message.lr, rel=1e-12, abs=1e-15)

    # Stopped gracefully: a checkpoint of the last step, and the result says it stopped early.
    result = trainer_pb2.TrainingResult()
    assert done.response.Unpack(result)
    assert result.final_step == last and result.stopped_early
    assert result.checkpoint_path == str(save / f"step-{last:06d}")
    assert Path(result.checkpoint_path).is_dir()
    assert result.summary.final_loss == streamed[-1].loss
    assert result.metrics_csv_path == str(logs / "metrics.csv")
    metadata = trainer_pb2.TrainingMetadata()
    assert done.metadata.Unpack(metadata)
    assert metadata.current_step == last and metadata.total_steps == 500


@pytest.mark.slow
def test_trainer_server_stops_a_job_without_saving_when_asked(
    servers: dict[str, ServerProcess], data_root: Path
) -> None:
    save = data_root / "train-nosave" / "save"
    args = _training_args(data_root, "--save", str(save))
    args[args.index("--train-iters") + 1] = "500"
    with _channel(servers["trainer"].port) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        started = stub.StartTraining(trainer_pb2.StartTrainingRequest(args=args), timeout=30)
        name = started.operation.name
        first = next(iter(stub.StreamMetrics(trainer_pb2.StreamMetricsRequest(name=name))))
        assert first.step == 1
        stop = trainer_pb2.StopTrainingRequest(name=name, save_checkpoint=False)
        stub.StopTraining(stop, timeout=30)
        operations = operations_pb2_grpc.OperationsServiceStub(channel)
        wait = operations_pb2.WaitOperationRequest(name=name, timeout_seconds=60)
        done = operations.WaitOperation(wait, timeout=90).operation
    assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
    result = trainer_pb2.TrainingResult()
    assert done.response.Unpack(result)
    assert result.stopped_early and 1 <= result.final_step < 500
    assert result.checkpoint_path == "" and not (save / "latest").exists()


def test_every_service_stops_on_sigterm_with_exit_code_0(servers: dict[str, ServerProcess]) -> None:
    for server in servers.values():
        server.process.send_signal(signal.SIGTERM)
    for server in servers.values():
        code = server.process.wait(timeout=STOP_TIMEOUT_S)
        assert server.eof.wait(10) and code == 0, (
            f"{server.name} exited with {code}:\n{server.log()}"
        )
        assert any("stopped serving" in line for line in server.lines), server.log()


def _free_port_block(count: int) -> int:
    """A base port with `count` consecutive ports free right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found")


def _wait_serving(port: int, service: str, deadline: float) -> None:
    while True:
        try:
            with _channel(port) as channel:
                if _health(channel, service) == health_pb2.HealthCheckResponse.SERVING:
                    return
        except (grpc.RpcError, grpc.FutureTimeoutError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_all_runs_five_services_and_ctrl_c_stops_them(data_root: Path) -> None:
    base = _free_port_block(len(SERVICES))
    command = [sys.executable, "-m", "services.cli", "serve", "all", "--base-port", str(base)]
    command += ["--data-root", str(data_root)]
    parent = _spawn(command, "all", new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for offset, name in enumerate(SERVICES):
            _wait_serving(base + offset, SERVICE_NAMES[name], deadline)
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", "\n".join(parent.lines))]
        assert len(pids) == len(SERVICES), parent.log()

        # Ctrl-C in a terminal: SIGINT to the whole foreground process group.
        os.killpg(parent.process.pid, signal.SIGINT)
        code = parent.process.wait(timeout=STOP_TIMEOUT_S)
        assert parent.eof.wait(10) and code == 0, parent.log()
        assert "all services stopped" in parent.log()
        assert not any(_pid_alive(pid) for pid in pids), "a child outlived `serve all`"
    finally:
        if parent.process.poll() is None:
            parent.process.kill()
            parent.process.wait()
