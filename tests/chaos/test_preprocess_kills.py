"""kill -9 the preprocess service at random points of a long job (fixed seed), restart it on the
same state dir, and check from outside: no worker left, no claim lost or doubled, no staging
folder or half-published output left, every operation in a true final state."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import grpc
import pytest

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2, preprocess_pb2_grpc
from tests.chaos.procs import Service, alive, db_rows, lock_is_free, start_service, wait_for

pytestmark = [pytest.mark.slow]
SEED = 37
KILLS = 2


FILES, DOCS = 4, 40000


def make_corpus(folder: Path, files: int = FILES, docs: int = DOCS) -> None:
    """JSON-lines files big enough that a job runs for a few seconds."""
    folder.mkdir()
    rng = random.Random(SEED)
    words = [f"w{i}" for i in range(300)]
    for f in range(files):
        lines = (
            json.dumps({"text": " ".join(rng.choices(words, k=60))}) + "\n" for _ in range(docs)
        )
        (folder / f"part{f}.jsonl").write_text("".join(lines))


def request(model: Path, corpus: Path, prefix: Path) -> preprocess_pb2.StartPreprocessRequest:
    return preprocess_pb2.StartPreprocessRequest(
        input=[str(corpus)],
        output_prefix=str(prefix),
        tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
        tokenizer_model=str(model),
        json_keys=["text"],
        append_eod=True,
        workers=2,
    )


def check_outputs_whole(prefix: Path) -> None:
    """Either nothing of `prefix` is visible, or a complete, readable dataset with its manifest."""
    from tokendata.indexed import IndexedDataset

    visible = sorted(p.name for p in prefix.parent.glob(f"{prefix.name}_*"))
    manifest = prefix.parent / f"{prefix.name}.manifest.json"
    if not visible:
        assert not manifest.exists(), "a manifest without its outputs"
        return
    assert visible == [f"{prefix.name}_text_document.bin", f"{prefix.name}_text_document.idx"]
    assert len(IndexedDataset(prefix.parent / f"{prefix.name}_text_document")) > 0


def start_job(service: Service, req: preprocess_pb2.StartPreprocessRequest) -> str:
    with service.channel() as channel:
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        return stub.StartPreprocess(req, timeout=60).operation.name


def get(service: Service, name: str) -> operations_pb2.Operation:
    with service.channel() as channel:
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        return ops.GetOperation(operations_pb2.GetOperationRequest(name=name), timeout=30).operation


def kill_at_progress(service: Service, name: str, fraction: float, kill: int) -> None:
    """Waits until the job has done `fraction` of the corpus's documents (its progress counts
    them), a random point of the run that does not depend on how fast this machine is; fails if
    the job ends first."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        operation = get(service, name)
        if operation.done:
            pytest.fail(f"kill {kill}: the job ended ({operation.state}) before the kill point")
        if operation.progress.completed >= fraction * FILES * DOCS:
            return
        time.sleep(0.05)
    pytest.fail(f"kill {kill}: the job reached {fraction:.0%} of its input within 120 s")


def test_preprocess_survives_random_kills(tmp_path: Path, sentencepiece_model: Path) -> None:
    rng = random.Random(SEED)
    data, state = tmp_path / "data", tmp_path / "state"
    data.mkdir()
    model = data / "tok.model"
    model.write_bytes(Path(sentencepiece_model).read_bytes())
    make_corpus(data / "corpus")
    prefix = data / "out" / "wiki"
    prefix.parent.mkdir()
    req = request(model, data / "corpus", prefix)

    service = start_service("preprocess", data, state)
    try:
        for kill in range(KILLS):
            name = start_job(service, req)
            kill_at_progress(service, name, rng.uniform(0.05, 0.6), kill)
            workers = service.kill9()
            wait_for(lambda w=workers: not alive(w), 60, f"kill {kill}: the job's workers to end")
            service = start_service("preprocess", data, state)
            operation = get(service, name)
            assert operation.done, f"kill {kill}: {name} is not in a final state after restart"
            if operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED:
                pytest.fail(
                    f"kill {kill}: the job finished before the kill; make the corpus larger"
                )
            assert operation.state == operations_pb2.OPERATION_STATE_FAILED
            assert operation.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert db_rows(state, "SELECT path, operation FROM claims") == []
            assert lock_is_free(prefix)
            assert not list(prefix.parent.glob(".*.partial-*")), "staging left after restart"
            check_outputs_whole(prefix)
        # The claim was neither lost nor stuck: a job on the same prefix runs to its end, and
        # holds exactly one claim while it runs.
        name = start_job(service, req)
        assert [row[1] for row in db_rows(state, "SELECT path, operation FROM claims")] in (
            [name],
            [],  # already finished
        )
        with service.channel() as channel:
            ops = operations_pb2_grpc.OperationsServiceStub(channel)
            wait = operations_pb2.WaitOperationRequest(name=name, timeout_seconds=120)
            done = ops.WaitOperation(wait, timeout=150).operation
        assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
        check_outputs_whole(prefix)
        assert (prefix.parent / "wiki.manifest.json").exists()
        assert not service.descendants() or all(
            "resource_tracker" in " ".join(p.cmdline()) for p in alive(service.descendants())
        )
    finally:
        service.stop()
