"""A restarted trainer stops the Kubernetes workload its dead predecessor left running (#37): the
launch records the workload in the state database, the store's `kubernetes` stopper suspends
it, and only then is the operation failed and its claim freed."""

from __future__ import annotations

import io
from pathlib import Path

import grpc

from meshline.common.v1 import operations_pb2
from services.common.k8s_jobs import K8sLaunchConfig
from services.common.operations import OperationsStore
from services.common.state_db import ProcessRecord
from services.trainer.k8s_launcher import KubernetesLauncher, stop_recorded_workload
from tests.k8s.fake_cluster import FakeCluster, done, running


def test_restarted_trainer_stops_the_workload_it_recorded(tmp_path: Path, monkeypatch) -> None:
    cluster = FakeCluster([[running("p-0")], [done("p-0")]], {"p-0": ["rank 0 starting"]})
    launcher = KubernetesLauncher(K8sLaunchConfig(poll_s=0.01), cluster, "meshline:test")
    monkeypatch.setattr(KubernetesLauncher, "in_cluster", classmethod(lambda cls: launcher))
    state = tmp_path / "state"
    store = OperationsStore(state)
    handle = store.create("train")
    handle.start()
    recorded: list[ProcessRecord] = []
    code = launcher.launch(
        ["--mock-data"], 1, output=io.StringIO(), operation=handle.name, on_started=recorded.append
    )
    assert code == 0
    (record,) = recorded
    assert record.launcher == "kubernetes" and record.host == "research"
    assert record.token == f"batch/v1 Job {cluster.created[-1]['metadata']['name']}"
    store.record_process(record)

    # The server dies here (its job still RUNNING); the next one over the state dir stops the
    # workload before it fails the operation.
    restarted = OperationsStore(state, stoppers={"kubernetes": stop_recorded_workload})
    assert cluster.stopped == [cluster.created[-1]["metadata"]["name"]]
    operation = restarted.get(handle.name)
    assert operation.state == operations_pb2.OPERATION_STATE_FAILED
    assert operation.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "was stopped (its pods save to --save first)" in operation.error.message
    assert restarted.db.process(handle.name) is None


def test_without_a_stopper_the_record_says_to_stop_it_by_hand(tmp_path: Path) -> None:
    store = OperationsStore(tmp_path)
    handle = store.create("train")
    token = "batch/v1 Job meshline-train-x"
    store.record_process(ProcessRecord(handle.name, "kubernetes", 0, 0, 0.0, token, "ns"))
    message = OperationsStore(tmp_path).get(handle.name).error.message
    assert f"its kubernetes job ({token}) cannot be stopped by this server" in message
