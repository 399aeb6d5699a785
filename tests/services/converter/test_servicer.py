"""ConverterService over gRPC with a real server on port 0: a conversion end to end as an
operation (progress metadata, typed result), a failed parity check as FAILED_PRECONDITION with no
output, a mismatched model as INVALID_ARGUMENT, paths outside the roots as PERMISSION_DENIED."""

from __future__ import annotations

import shutil

import grpc
import pytest
import torch

from checkpoints import megatron_layout
from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
from meshline.converter.v1 import converter_pb2, converter_pb2_grpc
from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import create_server
from services.converter.config import ConverterServiceConfig
from services.converter.servicer import bindings
from tests.services.common.helpers import arun

HF, NATIVE, MEGATRON = (
    checkpoint_pb2.CHECKPOINT_FORMAT_HF,
    checkpoint_pb2.CHECKPOINT_FORMAT_NATIVE,
    checkpoint_pb2.CHECKPOINT_FORMAT_MEGATRON,
)


async def _convert(root, request, watch=False):
    """Starts a server confined to `root`, sends `request`, waits; returns (operation, updates)."""
    store = OperationsStore(None)
    server, port, _ = await create_server(
        bindings(ConverterServiceConfig(data_roots=(root,)), store), ServerConfig(port=0)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            response = await converter_pb2_grpc.ConverterServiceStub(channel).Convert(request)
            name = response.operation.name
            ops = operations_pb2_grpc.OperationsServiceStub(channel)
            updates = []
            if watch:
                call = ops.WatchOperation(operations_pb2.WatchOperationRequest(name=name))
                async for update in call:
                    updates.append(update.operation)
            waited = await ops.WaitOperation(
                operations_pb2.WaitOperationRequest(name=name, timeout_seconds=120)
            )
            return waited.operation, updates
    finally:
        await server.stop(None)


def test_convert_end_to_end(llama_dir, tmp_path):
    root = tmp_path
    request = converter_pb2.ConvertRequest(
        load_format=HF,
        save_format=MEGATRON,
        load_dir=str(llama_dir),
        save_dir=str(root / "mg"),
        target_tensor_parallel_size=2,
        target_pipeline_parallel_size=2,
        verify=True,
    )
    # The HF fixture lives outside tmp_path: copy it under the root the server allows.
    shutil.copytree(llama_dir, root / "hf")
    request.load_dir = str(root / "hf")
    operation, updates = arun(_convert(root, request, watch=True), timeout=120)
    assert operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED, operation.error.message
    assert operation.kind == "convert"
    result = converter_pb2.ConvertResult()
    operation.response.Unpack(result)
    assert result.output_dir == str((root / "mg").resolve())
    assert "latest_checkpointed_iteration.txt" in result.files
    assert result.verify.passed and result.verify.max_abs_logit_diff == 0.0
    assert result.num_tensors == 1 + 4 * 6 + 2  # embedding, 4 layers x 6, final norm and head
    metadata = converter_pb2.ConvertMetadata()
    operation.metadata.Unpack(metadata)
    assert (metadata.tensors_done, metadata.layers_done) == (metadata.tensors_total, 4)
    assert metadata.request.target_tensor_parallel_size == 2
    assert updates and updates[-1].done  # the watch stream ended with the final state


def test_failed_verify_is_failed_precondition(llama_dir, tmp_path, monkeypatch):
    shutil.copytree(llama_dir, tmp_path / "hf")
    monkeypatch.setattr(
        megatron_layout, "_interleave_qkv", lambda q, k, v, groups: torch.cat([q, k, v])
    )
    request = converter_pb2.ConvertRequest(
        load_format=HF,
        save_format=MEGATRON,
        load_dir=str(tmp_path / "hf"),
        save_dir=str(tmp_path / "mg"),
        verify=True,
    )
    operation, _ = arun(_convert(tmp_path, request), timeout=120)
    assert operation.state == operations_pb2.OPERATION_STATE_FAILED
    assert operation.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "parity check failed" in operation.error.message
    assert not (tmp_path / "mg").exists() and not list(tmp_path.glob(".mg*"))


def test_mismatched_model_is_invalid_argument(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "hf")
    request = converter_pb2.ConvertRequest(
        load_format=HF,
        save_format=NATIVE,
        load_dir=str(tmp_path / "hf"),
        save_dir=str(tmp_path / "native"),
        model="tiny-bloom",
    )
    # Refused by the RPC itself, before save_dir is claimed: no operation, no claim lock file.
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        arun(_convert(tmp_path, request), timeout=120)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model" in caught.value.details() and "family" in caught.value.details()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("field", ["load_dir", "save_dir", "lora_load_dir"])
def test_paths_outside_roots_are_permission_denied(tmp_path, field):
    root = tmp_path / "root"
    (root / "hf").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    paths = {"load_dir": str(root / "hf"), "save_dir": str(root / "out"), "lora_load_dir": ""}
    paths[field] = str(tmp_path / "outside")
    request = converter_pb2.ConvertRequest(
        load_format=HF, save_format=NATIVE, merge_lora=field == "lora_load_dir", **paths
    )

    async def call():
        server, port, _ = await create_server(
            bindings(ConverterServiceConfig(data_roots=(root,)), OperationsStore(None)),
            ServerConfig(port=0),
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await converter_pb2_grpc.ConverterServiceStub(channel).Convert(request)
                return caught.value
        finally:
            await server.stop(None)

    error = arun(call())
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert field in error.details()


def test_second_job_on_the_same_output_is_aborted(llama_dir, tmp_path, monkeypatch):
    import time

    from checkpoints import hf_format

    shutil.copytree(llama_dir, tmp_path / "hf")
    read_unit = hf_format.HFSource.read_unit

    def slow_read_unit(self, unit):  # keeps the first job running while the second arrives
        time.sleep(0.2)
        return read_unit(self, unit)

    monkeypatch.setattr(hf_format.HFSource, "read_unit", slow_read_unit)
    request = converter_pb2.ConvertRequest(
        load_format=HF,
        save_format=NATIVE,
        load_dir=str(tmp_path / "hf"),
        save_dir=str(tmp_path / "out"),
    )

    async def body():
        server, port, _ = await create_server(
            bindings(ConverterServiceConfig(data_roots=(tmp_path,)), OperationsStore(None)),
            ServerConfig(port=0),
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = converter_pb2_grpc.ConverterServiceStub(channel)
                first = await stub.Convert(request)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Convert(request)
                ops = operations_pb2_grpc.OperationsServiceStub(channel)
                done = await ops.WaitOperation(
                    operations_pb2.WaitOperationRequest(
                        name=first.operation.name, timeout_seconds=60
                    )
                )
                return caught.value, done.operation
        finally:
            await server.stop(None)

    error, first = arun(body(), timeout=120)
    assert error.code() == grpc.StatusCode.ABORTED and "save_dir" in error.details()
    assert first.state == operations_pb2.OPERATION_STATE_SUCCEEDED
    assert (tmp_path / "out" / "latest").is_file()


@pytest.mark.slow
@pytest.mark.dist
def test_deepspeed_source_and_read_only_formats(deepspeed_checkpoints, tmp_path):
    from services.common.errors import InvalidArgument
    from services.converter.servicer import check_fields
    from tests.services.converter.test_deepspeed import two_tags

    # DeepSpeed's own files: `latest` names step 2 (ZeRO-2); load_iteration picks step 1 (ZeRO-3)
    two_tags(deepspeed_checkpoints, tmp_path / "ds")
    request = converter_pb2.ConvertRequest(
        load_format=checkpoint_pb2.CHECKPOINT_FORMAT_DEEPSPEED,
        save_format=HF,
        load_dir=str(tmp_path / "ds"),
        save_dir=str(tmp_path / "hf"),
        load_iteration=1,
        verify=True,
    )
    operation, _ = arun(_convert(tmp_path, request), timeout=120)
    assert operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED, operation.error.message
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    for save_format in (
        checkpoint_pb2.CHECKPOINT_FORMAT_DEEPSPEED,
        checkpoint_pb2.CHECKPOINT_FORMAT_FSDP,
    ):
        bad = converter_pb2.ConvertRequest(
            load_format=HF, save_format=save_format, load_dir="a", save_dir="b"
        )
        with pytest.raises(InvalidArgument, match="read only"):
            check_fields(bad, ConverterServiceConfig(data_roots=(tmp_path,)))
    bad = converter_pb2.ConvertRequest(
        load_format=HF, save_format=NATIVE, load_dir="a", save_dir="b", lora_r=4
    )
    with pytest.raises(InvalidArgument, match="lora_r"):
        check_fields(bad, ConverterServiceConfig(data_roots=(tmp_path,)))
