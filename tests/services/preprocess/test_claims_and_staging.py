"""#37 finding 2: a sharded job and a plain job on its shard prefix are one claim; staging dirs
belong to their job (never deleted by another job, in this process or another)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2, preprocess_pb2_grpc
from services.common.client import make_channel
from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.safe_fs import open_dir
from services.common.server import create_server
from services.preprocess import staging
from services.preprocess.config import PreprocessServiceConfig
from services.preprocess.servicer import bindings


def _request(model: Path, prefix: Path, corpus: Path, **fields: object):
    return preprocess_pb2.StartPreprocessRequest(
        input=[str(corpus)],
        output_prefix=str(prefix),
        tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
        tokenizer_model=str(model),
        json_keys=["text"],
        append_eod=True,
        **fields,
    )


def test_sharded_and_plain_job_on_one_shard_prefix_conflict(
    tmp_path: Path, sentencepiece_model: Path
) -> None:
    model = tmp_path / "tok.model"
    model.write_bytes(Path(sentencepiece_model).read_bytes())
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for i in range(2):
        lines = "".join(json.dumps({"text": f"document {i} {j} " * 40}) + "\n" for j in range(3000))
        (corpus_dir / f"part{i}.jsonl").write_text(lines)
    prefix = tmp_path / "P"
    sharded = _request(model, prefix, corpus_dir, num_shards=2, shard_index=0)
    plain = _request(model, tmp_path / "P-shard-00000-of-00002", corpus_dir)

    async def main() -> tuple[operations_pb2.Operation, object, object]:
        store = OperationsStore(tmp_path / "state")
        config = PreprocessServiceConfig(data_roots=(tmp_path,), max_workers=1)
        server, port, _ = await create_server(bindings(config, store), ServerConfig())
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
                ops = operations_pb2_grpc.OperationsServiceStub(channel)
                first = (await stub.StartPreprocess(sharded, timeout=30)).operation
                try:
                    second: object = await stub.StartPreprocess(plain, timeout=30)
                except grpc.aio.AioRpcError as error:
                    second = error
                wait = operations_pb2.WaitOperationRequest(name=first.name, timeout_seconds=120)
                done = (await ops.WaitOperation(wait, timeout=150)).operation
                try:
                    third: object = await stub.StartPreprocess(plain, timeout=30)
                except grpc.aio.AioRpcError as error:
                    third = error
                return done, second, third
        finally:
            await server.stop(None)

    done, second, third = asyncio.run(main())
    assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
    # While the sharded job ran, the plain job on its shard prefix was refused, naming it.
    assert isinstance(second, grpc.aio.AioRpcError), "both jobs were accepted"
    assert second.code() == grpc.StatusCode.ABORTED
    assert done.name in second.details() and "P-shard-00000-of-00002" in second.details()
    # Afterwards it finds the sharded job's outputs and does not overwrite them silently.
    assert isinstance(third, grpc.aio.AioRpcError)
    assert third.code() == grpc.StatusCode.FAILED_PRECONDITION
    manifest = json.loads((tmp_path / "P-shard-00000-of-00002.manifest.json").read_text())
    assert manifest["shard"]["num_shards"] == 2
    assert not list(tmp_path.glob(".P-shard-*.partial-*")), "no staging folder left behind"


def test_a_new_staging_dir_is_never_stale_to_another_job(tmp_path: Path) -> None:
    stage = staging.create(tmp_path, "P")
    where = tmp_path / stage.name
    try:
        # Another job of this process starting for the same name must keep it.
        with open_dir(tmp_path, (), "output_prefix") as out:
            assert staging.remove_stale(out, "P") == []
        assert where.is_dir()
    finally:
        staging.release(stage)
    assert not where.exists()


_OTHER_JOB = """
import sys, time
from pathlib import Path
from services.preprocess import staging
print(staging.create(Path(sys.argv[1]), "P").name, flush=True)
time.sleep(600)
"""


def test_staging_dir_of_a_job_in_another_process_is_kept_until_it_dies(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _OTHER_JOB, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        stage = tmp_path / proc.stdout.readline().strip()
        assert stage.is_dir()
        with open_dir(tmp_path, (), "output_prefix") as out:
            assert staging.remove_stale(out, "P") == []
        assert staging.sweep([tmp_path]) == []
        assert stage.is_dir(), "a running job's staging folder was deleted by another"
    finally:
        proc.kill()
        proc.wait()
    # Its owner is dead (the kernel dropped its lock): now it is stale.
    with open_dir(tmp_path, (), "output_prefix") as out:
        assert staging.remove_stale(out, "P") == [stage.name]
    assert not stage.exists()
