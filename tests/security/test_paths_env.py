"""Paths and environment as an attacker uses them: symlinks leaving the root, swaps after the
check, files inside a request's folder that point elsewhere, staging left by killed jobs.

Request-level cases run real servers on localhost (port 0); helper-level cases exercise the
shared `services.common.paths` functions every service uses. Each asserts containment by its
side effect (a secret that must not reach any output, a file that must not appear outside the
root, a sentinel that must survive), not by the error text alone.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import psutil
import pytest

from meshline.common.v1 import checkpoint_pb2, operations_pb2
from meshline.converter.v1 import converter_pb2, converter_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2, preprocess_pb2_grpc
from services.common.errors import PermissionDenied
from services.common.operations import OperationsStore, run_in_thread
from services.common.paths import ROOTS_ENV, check_at_use, open_resolved, resolve_under_roots
from services.common.server import ServiceBinding
from services.converter.config import ConverterServiceConfig
from services.converter.servicer import bindings as converter_bindings
from services.evaluator.config import EvaluatorServiceConfig
from services.evaluator.servicer import bindings as evaluator_bindings
from services.preprocess import staging
from services.preprocess.config import PreprocessServiceConfig
from services.preprocess.servicer import bindings as preprocess_bindings
from services.trainer.arguments import parse_args
from services.trainer.job import failure_status
from services.trainer.request_paths import argv_from_config
from services.trainer.worker_env import ALLOWED, env_violations
from tests.security import paths_fixtures
from tests.security.paths_fixtures import wait_operation
from tests.services.evaluator.servers import ServerThread

# The shared fixtures, bound here so pytest finds them (see paths_fixtures).
root, outside = paths_fixtures.root, paths_fixtures.outside

SECRET = "SECRET-8d1f3a"


def _tree_text(folder: Path) -> str:
    """Every readable file under `folder`, concatenated (to look for a leaked secret)."""
    out = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            out.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(out)


# ---- the shared helper at use time ----------------------------------------------------------


def test_open_resolved_refuses_a_directory_swapped_for_a_symlink_before_reading(
    root: Path, outside: Path
) -> None:
    (outside / "data.jsonl").write_text(SECRET)
    (root / "tasks").mkdir()
    (root / "tasks" / "data.jsonl").write_text("{}")
    checked = resolve_under_roots(str(root / "tasks" / "data.jsonl"), (root,), "task_data_path")
    (root / "tasks").rename(root / "tasks.orig")
    (root / "tasks").symlink_to(outside, target_is_directory=True)
    read: list[str] = []
    with (
        pytest.raises(PermissionDenied),
        open(open_resolved(checked, "task_data_path"), encoding="utf-8") as fh,
    ):
        read.append(fh.read())
    assert read == []


def test_open_resolved_refuses_a_swap_before_creating_a_file(root: Path, outside: Path) -> None:
    (root / "out").mkdir()
    checked = resolve_under_roots(str(root / "out" / "results.json"), (root,), "output_path")
    (root / "out").rename(root / "out.orig")
    (root / "out").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied):
        os.close(open_resolved(checked, "output_path", os.O_WRONLY | os.O_CREAT))
    # The refusal closed the descriptor; the file it briefly created outside is the only trace
    # a kernel without openat2 leaves, and nothing was written into it.
    created = outside / "results.json"
    assert not created.exists() or created.stat().st_size == 0


def test_open_resolved_refuses_a_final_symlink(root: Path, outside: Path) -> None:
    (outside / "secret").write_text(SECRET)
    (root / "file").symlink_to(outside / "secret")
    with pytest.raises(PermissionDenied):
        os.close(open_resolved(root / "file", "field"))


def test_checkpoint_manager_refuses_a_save_dir_swapped_after_the_first_save(
    root: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.services.trainer.test_checkpoint import _fresh_state
    from training.checkpoint import CheckpointManager

    monkeypatch.setenv(ROOTS_ENV, str(root))
    (root / "run").mkdir()
    manager = CheckpointManager(root / "run" / "ckpt", path_guard=check_at_use)
    state = _fresh_state()
    manager.save(1, state)
    (root / "run").rename(root / "run.orig")
    (root / "run").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied):
        manager.save(2, state)
    assert list(outside.iterdir()) == []
    assert (root / "run.orig" / "ckpt" / "latest").read_text().strip() == "1"


def test_check_at_use_without_service_roots_allows_operator_paths(
    outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`meshline train` run by the operator (no service, no roots) keeps any path."""
    monkeypatch.delenv(ROOTS_ENV, raising=False)
    assert check_at_use(outside, "--save") == outside.resolve()


# ---- evaluator: task files inside the task folder -------------------------------------------


class RecordingInference(inference_pb2_grpc.InferenceServiceServicer):
    """An inference endpoint that answers GetModelInfo and records every other request: what
    an evaluation sends to a model is where the contents of a leaked file would go."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def GetModelInfo(self, request, context):
        return inference_pb2.GetModelInfoResponse(model_name="recorder", context_length=256)

    async def _record(self, request, context):
        self.seen.append(str(request))
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "recorder")

    Generate = GenerateStream = Score = Tokenize = Detokenize = _record


def _recording_endpoint() -> tuple[ServerThread, RecordingInference]:
    recorder = RecordingInference()
    binding = ServiceBinding(
        "meshline.inference.v1.InferenceService",
        recorder,
        inference_pb2_grpc.add_InferenceServiceServicer_to_server,
    )
    return ServerThread([binding]), recorder


def _boolq_record(passage: str) -> str:
    return f'{{"question": "is it", "passage": "{passage}", "label": true}}\n'


def _gsm8k_record(text: str) -> str:
    return f'{{"question": "{text}", "answer": "1 #### 1"}}\n'


@pytest.mark.parametrize("case", ["boolq_dev", "boolq_train_sibling", "gsm8k_train_sibling"])
def test_evaluator_task_file_symlinked_outside_is_not_read(
    case: str, root: Path, outside: Path
) -> None:
    tasks = root / "tasks"
    tasks.mkdir()
    task = "gsm8k" if case.startswith("gsm8k") else "boolq"
    if case == "boolq_dev":
        (outside / "stolen.jsonl").write_text(_boolq_record(SECRET))
        (tasks / "dev.jsonl").symlink_to(outside / "stolen.jsonl")
    elif case == "boolq_train_sibling":
        (tasks / "dev.jsonl").write_text(_boolq_record("fine"))
        (outside / "stolen.jsonl").write_text(_boolq_record(SECRET))
        (tasks / "train.jsonl").symlink_to(outside / "stolen.jsonl")
    else:
        (tasks / "test.jsonl").write_text(_gsm8k_record("fine"))
        (outside / "stolen.jsonl").write_text(_gsm8k_record(SECRET))
        (tasks / "train.jsonl").symlink_to(outside / "stolen.jsonl")
    config = EvaluatorServiceConfig(data_roots=(root,))
    endpoint, recorder = _recording_endpoint()
    server = ServerThread(evaluator_bindings(config, OperationsStore(None)))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = evaluator_pb2_grpc.EvaluatorServiceStub(channel)
            request = evaluator_pb2.StartEvaluationRequest(
                tasks=[task],
                task_data_path=str(tasks),
                endpoint=endpoint.address,
                num_fewshot=1,
            )
            name = stub.StartEvaluation(request, timeout=30).operation.name
        operation = wait_operation(server.address, name, timeout=60)
    finally:
        server.stop()
        endpoint.stop()
    assert operation.state == operations_pb2.OPERATION_STATE_FAILED
    assert operation.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0], operation.error
    assert SECRET not in _tree_text(root)
    assert not any(SECRET in seen for seen in recorder.seen)


# ---- preprocess: inputs and staging ---------------------------------------------------------


def test_preprocess_input_folder_with_a_symlink_outside_writes_nothing(
    root: Path, outside: Path, sentencepiece_model: Path
) -> None:
    (outside / "secret.jsonl").write_text(f'{{"text": "{SECRET}"}}\n')
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "hello world"}\n')
    (corpus / "b.jsonl").symlink_to(outside / "secret.jsonl")
    tokenizer = root / "tok.model"
    shutil.copy(sentencepiece_model, tokenizer)
    (root / "out").mkdir()
    server = ServerThread(
        preprocess_bindings(PreprocessServiceConfig(data_roots=(root,)), OperationsStore(None))
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
            request = preprocess_pb2.StartPreprocessRequest(
                input=[str(corpus)],
                output_prefix=str(root / "out" / "corpus"),
                tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
                tokenizer_model=str(tokenizer),
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.StartPreprocess(request, timeout=30)
    finally:
        server.stop()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert list((root / "out").iterdir()) == []


def _owned_stage(directory: Path, name: str, pid: int, started: float) -> Path:
    stage = directory / f".{name}.partial-{pid % 100_000_000:08d}"
    stage.mkdir()
    (stage / staging.OWNER_FILE).write_text(f"{pid} {started!r}")
    (stage / "corpus_text_document.bin.partial").write_bytes(b"\0" * 64)
    return stage


def test_stale_staging_of_killed_jobs_is_removed_at_service_start(root: Path) -> None:
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed_started = psutil.Process(killed.pid).create_time()
    killed.kill()
    killed.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = root / "a" / "b"
        out.mkdir(parents=True)
        stale = _owned_stage(out, "corpus", killed.pid, killed_started)
        running = _owned_stage(out, "other", alive.pid, psutil.Process(alive.pid).create_time())
        notes = out / ".notes.partial-keep-me"
        notes.mkdir()
        (notes / "sentinel").write_text("mine")
        preprocess_bindings(PreprocessServiceConfig(data_roots=(root,)), OperationsStore(None))
        assert not stale.exists()
        assert running.exists()
        assert (notes / "sentinel").read_text() == "mine"
    finally:
        alive.kill()
        alive.wait()


def test_stale_staging_for_the_same_output_is_removed_at_job_start(root: Path) -> None:
    stale = _owned_stage(root, "corpus", 2**22 + 12345, 1.0)
    mine = staging.create(root, "corpus")
    try:
        assert not stale.exists()
        assert (root / mine.name).is_dir()
        assert staging.remove_stale(mine.output, "corpus") == []  # a running job's is kept
    finally:
        staging.release(mine)
    assert not (root / mine.name).exists()


# ---- converter: the source folder's contents ------------------------------------------------


def test_converter_source_with_a_symlink_outside_is_refused(root: Path, outside: Path) -> None:
    (outside / "config.json").write_text(f'{{"model_type": "{SECRET}"}}')
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").symlink_to(outside / "config.json")
    server = ServerThread(
        converter_bindings(ConverterServiceConfig(data_roots=(root,)), OperationsStore(None))
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = converter_pb2_grpc.ConverterServiceStub(channel)
            request = converter_pb2.ConvertRequest(
                load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF,
                save_format=checkpoint_pb2.CHECKPOINT_FORMAT_NATIVE,
                load_dir=str(hf),
                save_dir=str(root / "native"),
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.Convert(request, timeout=30)
    finally:
        server.stop()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not (root / "native").exists()


# ---- environment allow-list, resolved flags, disk-full mapping ------------------------------

_GOOD_VALUES = {
    "NCCL_DEBUG": "WARN",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
    "NCCL_P2P_LEVEL": "NVL",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_ALGO": "Ring,Tree",
    "NCCL_PROTO": "Simple",
    "HCCL_DETERMINISTIC": "true",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
    "GLOO_SOCKET_IFNAME": "eth0",
    "HCCL_SOCKET_IFNAME": "eth0",
}


def test_every_allowed_variable_accepts_a_documented_value() -> None:
    env = {name: _GOOD_VALUES.get(name, "1") for name in ALLOWED}
    assert env_violations(env) == []


def test_argv_from_config_round_trips_the_resolved_config(root: Path) -> None:
    argv = [
        *("--model", "tiny-llama", "--train-iters", "7", "--lr", "1e-05", "--zero-stage", "2"),
        *("--data-path", "0.3", str(root / "a"), "0.7", str(root / "b")),
        *("--tokenizer-type", "SentencePiece", "--tokenizer-model", str(root / "t.model")),
        *("--tensorboard-dir", str(root / "tb"), "--recompute-activations", "--pack"),
        *("--rampup-batch-size", "2", "2", "10", "--global-batch-size", "8"),
    ]
    config = parse_args(argv)
    assert parse_args(argv_from_config(config)) == config


def test_disk_full_in_a_job_is_resource_exhausted_naming_the_path(root: Path) -> None:
    store = OperationsStore(None)
    handle = store.create("probe", operations_pb2.Progress())
    target = root / "out" / "shard.bin"

    def job(handle):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    run_in_thread(store, handle, job).join(timeout=30)
    operation = store.get(handle.name)
    assert operation.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "no space left" in operation.error.message and str(target) in operation.error.message


def test_trainer_disk_full_is_found_however_early_it_was_printed() -> None:
    config = parse_args(["--model", "tiny-llama", "--mock-data", "--save", "/data/ckpt"])
    lines = ["OSError: [Errno 28] No space left on device: '/data/ckpt/step-000001.tmp'"]
    code, message = failure_status(1, lines + ["traceback"] * 30, config)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "/data/ckpt" in message


def test_preprocess_output_dir_swapped_for_a_symlink_is_neither_written_nor_replaced(
    root: Path, outside: Path, sentencepiece_model: Path
) -> None:
    """The prefix was checked, then its directory became a symlink out: with `overwrite`, the
    job would replace (delete) the same-named files there. The sentinel must survive."""
    from services.preprocess.job import run_preprocess
    from services.preprocess.job_config import PreprocessConfig

    (root / "in.jsonl").write_text('{"text": "hello world"}\n' * 4)
    sentinel = outside / "corpus_text_document.idx"
    sentinel.write_text("not yours")
    (root / "out").symlink_to(outside, target_is_directory=True)
    config = PreprocessConfig(
        input=(str(root / "in.jsonl"),),
        output_prefix=str(root / "out" / "new" / "corpus"),
        tokenizer_type="SentencePiece",
        tokenizer_model=str(sentencepiece_model),
        overwrite=True,
        workers=1,
    )
    with pytest.raises(PermissionDenied):
        run_preprocess(config, roots=(root,))
    with pytest.raises(PermissionDenied):
        run_preprocess(replace(config, output_prefix=str(root / "out" / "corpus")), roots=(root,))
    assert sentinel.read_text() == "not yours"
    assert sorted(p.name for p in outside.iterdir()) == ["corpus_text_document.idx"]
