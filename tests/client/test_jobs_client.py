"""JobsClient: start a real preprocess job on a localhost server and follow it to the end."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import grpc
import pytest

from meshline.common.v1 import operations_pb2 as ops
from meshline.preprocess.v1 import preprocess_pb2
from meshline_client import Connection, JobsClient
from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import create_server
from services.preprocess.config import PreprocessServiceConfig
from services.preprocess.servicer import bindings


@pytest.fixture
def preprocess_server(tmp_path):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    store = OperationsStore(None)
    config = PreprocessServiceConfig(data_roots=(tmp_path,), max_workers=1)
    server, port, _ = asyncio.run_coroutine_threadsafe(
        create_server(bindings(config, store), ServerConfig(port=0)), loop
    ).result(30)
    yield port
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    store.shutdown(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_run_follows_a_job_to_success_and_reports_failure(
    tmp_path, sentencepiece_model, preprocess_server
):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"the model reads line {i}"}) + "\n" for i in range(50))
    )
    (tmp_path / "shards").mkdir()
    model = tmp_path / "tok.model"
    shutil.copy(sentencepiece_model, model)
    request = preprocess_pb2.StartPreprocessRequest(
        input=[str(corpus)],
        output_prefix=str(tmp_path / "shards" / "corpus"),
        tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
        tokenizer_model=str(model),
        json_keys=["text"],
        append_eod=True,
    )
    seen: list[ops.Operation] = []
    with JobsClient(Connection(f"127.0.0.1:{preprocess_server}", timeout_s=60)) as jobs:
        done = jobs.run("preprocess", request, timeout_s=120, on_progress=seen.append)
        assert done.state == ops.OPERATION_STATE_SUCCEEDED and done.done
        assert seen and seen[-1].name == done.name
        assert jobs.get(done.name).state == ops.OPERATION_STATE_SUCCEEDED
        assert jobs.wait(done.name, timeout_s=30).name == done.name
        assert list((tmp_path / "shards").iterdir()), "the job wrote its shards"
        missing = preprocess_pb2.StartPreprocessRequest()
        missing.CopyFrom(request)
        del missing.input[:]
        missing.input.append(str(tmp_path / "gone.jsonl"))
        missing.output_prefix = str(tmp_path / "shards" / "other")
        with pytest.raises(grpc.RpcError) as rejected:
            jobs.start("preprocess", missing)
        assert rejected.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError, match="kind"):
            jobs.start("bake", request)
