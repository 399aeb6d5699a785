"""PreprocessService over a real in-process gRPC server: HF dataset inputs and output clashes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2, preprocess_pb2_grpc
from models.tokenizer import build_tokenizer
from services.common.client import make_channel
from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import create_server
from services.preprocess.config import PreprocessServiceConfig
from services.preprocess.servicer import bindings
from tokendata.indexed import IndexedDataset

TEXTS = [
    "def add(a, b):\n    return a + b",
    "import os\nprint(os.getcwd())",
    "x = [i for i in range(3)]",
]


def _run(data_root: Path, requests: list[preprocess_pb2.StartPreprocessRequest]) -> list[object]:
    """Sends each request to a fresh server; returns the finished operation or the RpcError."""

    async def main() -> list[object]:
        store = OperationsStore(None)
        config = PreprocessServiceConfig(data_roots=(data_root,), max_workers=1)
        server, port, _ = await create_server(bindings(config, store), ServerConfig())
        outcomes: list[object] = []
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
                operations = operations_pb2_grpc.OperationsServiceStub(channel)
                for request in requests:
                    try:
                        started = (await stub.StartPreprocess(request, timeout=30)).operation
                    except grpc.aio.AioRpcError as error:
                        outcomes.append(error)
                        continue
                    wait = operations_pb2.WaitOperationRequest(
                        name=started.name, timeout_seconds=90
                    )
                    outcomes.append((await operations.WaitOperation(wait, timeout=120)).operation)
        finally:
            await server.stop(None)
        return outcomes

    return asyncio.run(main())


def _request(model: Path, prefix: Path, **fields: object) -> preprocess_pb2.StartPreprocessRequest:
    return preprocess_pb2.StartPreprocessRequest(
        output_prefix=str(prefix),
        tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
        tokenizer_model=str(model),
        json_keys=["text"],
        append_eod=True,
        **fields,
    )


def test_hf_json_builder_input_and_sibling_prefixes(
    tmp_path: Path, sentencepiece_model: Path
) -> None:
    model = tmp_path / "tok.model"
    model.write_bytes(Path(sentencepiece_model).read_bytes())
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    hf = preprocess_pb2.HfDatasetParams(path="json", split="train", data_files=[str(corpus)])
    # `c_v2` first: a later run with prefix `c` must not take its files for its own.
    sibling = _request(model, tmp_path / "c_v2", input=[str(corpus)])
    from_hf = _request(model, tmp_path / "c", hf_dataset=hf)
    again = _request(model, tmp_path / "c", hf_dataset=hf)
    first, second, third = _run(tmp_path, [sibling, from_hf, again])

    for operation in (first, second):
        assert isinstance(operation, operations_pb2.Operation)
        assert operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED, operation.error.message
    tokenizer = build_tokenizer("SentencePiece", model)
    dataset = IndexedDataset(tmp_path / "c_text_document")
    assert [list(dataset[i]) for i in range(len(dataset))] == [
        [*tokenizer.encode(text, add_special_tokens=True), tokenizer.eod_id] for text in TEXTS
    ]
    assert isinstance(third, grpc.aio.AioRpcError)
    assert third.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Exactly this prefix's manifest, .bin and .idx: none of c_v2's files.
    assert "3 output file(s)" in third.details() and "c.manifest.json" in third.details()


def test_hf_builder_without_data_files_is_invalid(
    tmp_path: Path, sentencepiece_model: Path
) -> None:
    model = tmp_path / "tok.model"
    model.write_bytes(Path(sentencepiece_model).read_bytes())
    request = _request(
        model, tmp_path / "c", hf_dataset=preprocess_pb2.HfDatasetParams(path="json")
    )
    (error,) = _run(tmp_path, [request])
    assert isinstance(error, grpc.aio.AioRpcError)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hf_dataset.data_files" in error.details()


@pytest.mark.parametrize("spec", ["json"])
def test_reader_rejects_builder_without_files(spec: str) -> None:
    from services.preprocess.readers import resolve_input

    with pytest.raises(ValueError, match="data_files"):
        resolve_input(spec, {"split": "train"})
