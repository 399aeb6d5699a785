"""kill -9 the converter service at random points of a conversion (fixed seed), restart it on the
same state dir, and check from outside: no half-visible output, no staging folder left (the
restart sweeps it), the claim freed, the operation in a true final state; then the same request
succeeds without `overwrite`."""

from __future__ import annotations

import random
import time
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
from meshline.converter.v1 import converter_pb2, converter_pb2_grpc
from services.converter.output_dir import MARKER
from tests.chaos.procs import Service, alive, db_rows, lock_is_free, start_service, wait_for

pytestmark = [pytest.mark.slow]
SEED = 37
KILLS = 2


def make_checkpoint(folder: Path) -> Path:
    """An HF Llama big enough (~31M parameters, 125 MB) that converting and verifying it takes
    seconds even on an idle machine (at ~12M, an idle 2-core box converted it between two polls)."""
    config = LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def convert_request(source: Path, output: Path) -> converter_pb2.ConvertRequest:
    return converter_pb2.ConvertRequest(
        load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF,
        save_format=checkpoint_pb2.CHECKPOINT_FORMAT_NATIVE,
        load_dir=str(source),
        save_dir=str(output),
        verify=True,
    )


def start_convert(service: Service, request: converter_pb2.ConvertRequest) -> str:
    with service.channel() as channel:
        stub = converter_pb2_grpc.ConverterServiceStub(channel)
        return stub.Convert(request, timeout=60).operation.name


def get(service: Service, name: str) -> operations_pb2.Operation:
    with service.channel() as channel:
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        return ops.GetOperation(operations_pb2.GetOperationRequest(name=name), timeout=30).operation


def output_whole_or_absent(output: Path) -> bool:
    """Either no output folder, or one the converter finished (its manifest written last)."""
    return not output.exists() or (output / MARKER).is_file()


def staging_left(output: Path) -> list[Path]:
    return [p for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]


def kill_at_progress(service: Service, name: str, fraction: float, kill: int) -> bool:
    """Waits until `fraction` of the tensors are converted; False if the job ended first."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        operation = get(service, name)
        if operation.done:
            return False
        metadata = converter_pb2.ConvertMetadata()
        operation.metadata.Unpack(metadata)
        total = metadata.tensors_total
        if total and metadata.tensors_done >= fraction * total:
            return True
        time.sleep(0.02)
    pytest.fail(f"kill {kill}: the conversion reached {fraction:.0%} within 120 s")


def test_converter_survives_random_kills(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    data, state = tmp_path / "data", tmp_path / "state"
    data.mkdir()
    source = make_checkpoint(data / "hf")
    output = data / "out" / "native"
    output.parent.mkdir()
    request = convert_request(source, output)
    service = start_service("converter", data, state)
    mid_job = 0
    try:
        for kill in range(KILLS):
            name = start_convert(service, request)
            before_end = kill_at_progress(service, name, rng.uniform(0.1, 0.9), kill)
            service.kill9()
            assert output_whole_or_absent(output), f"kill {kill}: half-visible output"
            service = start_service("converter", data, state)
            operation = get(service, name)
            assert operation.done, f"kill {kill}: {name} is not final after the restart"
            # The job may still end between the last poll and the kill: judge by its final state.
            before_end = before_end and operation.state != operations_pb2.OPERATION_STATE_SUCCEEDED
            mid_job += before_end
            if before_end:
                assert operation.state == operations_pb2.OPERATION_STATE_FAILED
                assert operation.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert not output.exists(), f"kill {kill}: output of a failed conversion"
            else:  # it finished before the kill: a true SUCCEEDED with its whole output
                assert operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED
                assert (output / MARKER).is_file()
            wait_for(lambda: not staging_left(output), 30, f"kill {kill}: staging to be swept")
            assert db_rows(state, "SELECT path, operation FROM claims") == []
            assert lock_is_free(output)
            if output.exists():
                request.overwrite = True
        assert mid_job, "every conversion ended before its kill: make the checkpoint larger"
        # The restarted service runs the request to the end: nothing stale is in the way.
        name = start_convert(service, request)
        wait_for(lambda: get(service, name).done, 180, "the last conversion to end")
        final = get(service, name)
        assert final.state == operations_pb2.OPERATION_STATE_SUCCEEDED, final.error.message
        assert (output / MARKER).is_file() and not staging_left(output)
        assert not alive(service.descendants())
    finally:
        service.stop()
