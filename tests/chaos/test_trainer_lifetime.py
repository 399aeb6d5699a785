"""#37 finding 1: a trainer service killed with SIGKILL during a job orphans nothing.

Before: the workers kept running and checkpointing after the kill; after the restart the job said
FAILED UNAVAILABLE while a new job on the same --save was accepted, so two runs wrote one folder.
Now: the job's processes die with the service (parent-death signal to the agent, which stops its
workers), a restarted service stops any survivor before it fails the job and frees the claim, and
nothing writes into --save once the restart has answered.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.chaos.procs import alive, db_rows, lock_is_free, start_service, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def training_args(save: Path, iters: int = 100000, log_interval: int = 1) -> list[str]:
    """A tiny-llama mock-data run that checkpoints often."""
    return [
        *("--model", "tiny-llama", "--mock-data", "--train-iters", str(iters)),
        *("--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "32"),
        *("--log-interval", str(log_interval), "--save", str(save), "--save-interval", "2"),
    ]


def _files(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


def test_killed_trainer_service_leaves_no_worker_and_a_true_state(tmp_path: Path) -> None:
    data, state = tmp_path / "data", tmp_path / "state"
    data.mkdir()
    save = data / "ckpt"
    trainer = start_service("trainer", data, state)
    try:
        with trainer.channel() as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            # Rare metrics lines: a worker that printed into the dead server's pipe would die of
            # EPIPE by chance; the guarantee must not rest on that.
            args = training_args(save, log_interval=100000)
            request = trainer_pb2.StartTrainingRequest(args=args)
            name = stub.StartTraining(request, timeout=60).operation.name
            wait_for(lambda: (save / "latest").exists(), 180, "the first checkpoint")
        workers = trainer.kill9()
        assert len(workers) >= 2, "the agent and its worker were running"
    finally:
        trainer.stop()

    # The agent got SIGTERM from the kernel when its parent died, and stopped its worker.
    wait_for(lambda: not alive(workers), 90, "the job's processes to end with their service")
    written = _files(save)

    restarted = start_service("trainer", data, state)
    try:
        with restarted.channel() as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            ops = operations_pb2_grpc.OperationsServiceStub(channel)
            get = operations_pb2.GetOperationRequest(name=name)
            operation = ops.GetOperation(get, timeout=30).operation
            assert operation.done and operation.state == operations_pb2.OPERATION_STATE_FAILED
            assert operation.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "server restarted while the operation was" in operation.error.message
            with pytest.raises(grpc.RpcError) as caught:
                stub.StopTraining(trainer_pb2.StopTrainingRequest(name=name), timeout=30)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert db_rows(state, "SELECT path FROM claims") == []
            # Nothing of the old run writes any more: the folder is the same a while later.
            time.sleep(3)
            assert _files(save) == written, "the killed service's training still writes"
            # The folder's claim is free on the file system too: a new run may take it.
            assert lock_is_free(save)
    finally:
        restarted.stop()
