"""TrainerService with the Kubernetes launcher, over real gRPC on localhost: a 2-node job is
accepted (multi-node needs the cluster), its workload carries the request, its pods' metrics
stream back and their failures become the operation's error code. The cluster is the scripted
stand-in of tests/k8s/fake_cluster.py."""

from __future__ import annotations

import json

import grpc

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.config import ServerConfig
from services.common.k8s_jobs import K8sLaunchConfig
from services.common.operations import OperationsStore
from services.common.server import create_server
from services.trainer.config import TrainerServiceConfig
from services.trainer.k8s_launcher import KubernetesLauncher
from services.trainer.servicer import bindings
from tests.k8s.fake_cluster import FakeCluster, done, running
from tests.services.common.helpers import arun


def _record(step: int, loss: float) -> str:
    values = dict(step=step, loss=loss, grad_norm=1.0, lr=1e-3, tokens_per_s=100.0, tflops=0.1,
                  mfu=0.0, mem_gb=0.5, skipped=0, nan=0, elapsed_s=2.0)  # fmt: skip
    return "METRICS:" + json.dumps(values)  # framed by the fake cluster with the job's nonce


def _start(tmp_path, monkeypatch, cluster: FakeCluster, nnodes: int):
    launcher = KubernetesLauncher(K8sLaunchConfig(poll_s=0.01), cluster, "meshline:test")
    monkeypatch.setattr(KubernetesLauncher, "in_cluster", classmethod(lambda cls: launcher))
    config = TrainerServiceConfig(data_roots=(tmp_path,), launcher="kubernetes")
    store = OperationsStore(None)
    request = trainer_pb2.StartTrainingRequest(
        args=["--model", "tiny-llama", "--mock-data", "--train-iters", "20",
              "--save", str(tmp_path / "ckpt")],
        nproc_per_node=2, nnodes=nnodes, env={"NCCL_DEBUG": "INFO"},
    )  # fmt: skip

    async def scenario():
        server, port, _ = await create_server(bindings(config, store), ServerConfig(port=0))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                started = await stub.StartTraining(request)
                name = started.operation.name
                ops = operations_pb2_grpc.OperationsServiceStub(channel)
                wait = operations_pb2.WaitOperationRequest(name=name, timeout_seconds=30)
                final = (await ops.WaitOperation(wait)).operation
                stream = stub.StreamMetrics(trainer_pb2.StreamMetricsRequest(name=name))
                metrics = [m async for m in stream]
                return name, final, metrics
        finally:
            await server.stop(0)

    return arun(scenario(), timeout=60)


def test_two_node_job_runs_as_a_workload_and_streams_its_metrics(tmp_path, monkeypatch):
    cluster = FakeCluster(
        [[running("w-0"), running("w-1")], [done("w-0"), done("w-1")]],
        logs={"w-0": [_record(10, 3.0), _record(20, 2.5)], "w-1": ["rank 2 ready"]},
    )
    name, final, metrics = _start(tmp_path, monkeypatch, cluster, nnodes=2)
    assert final.state == operations_pb2.OPERATION_STATE_SUCCEEDED, final.error.message
    assert [m.step for m in metrics] == [10, 20] and metrics[-1].loss == 2.5
    result = trainer_pb2.TrainingResult()
    final.response.Unpack(result)
    assert result.final_step == 20
    job = cluster.created[-1]
    assert job["metadata"]["annotations"]["meshline.dev/operation"] == name
    assert job["spec"]["completions"] == 2
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NPROC_PER_NODE"] == "2" and env["NCCL_DEBUG"] == "INFO"
    assert container["args"][-2:] == ["--save", str(tmp_path / "ckpt")]


def test_an_oom_killed_worker_fails_the_operation_resource_exhausted(tmp_path, monkeypatch):
    cluster = FakeCluster([[running("w-0")], [done("w-0", 137, "OOMKilled")]])
    _, final, _ = _start(tmp_path, monkeypatch, cluster, nnodes=1)
    assert final.state == operations_pb2.OPERATION_STATE_FAILED
    assert final.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "OOMKilled" in final.error.message
