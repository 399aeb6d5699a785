"""The trainer's Kubernetes launcher: pod states mapped to the operation's outcome, metrics from
pod logs, stop and failure handling, and the choice between it and the local launcher.

The launcher's API calls go through a small client interface (`KubeClient`); here a scripted
stand-in plays the cluster (there is no API server in CI), while the objects it receives are the
real manifests `k8s_jobs` builds."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest

from services.common.errors import Conflict, FailedPrecondition, ResourceExhausted, Unavailable
from services.common.k8s_client import api_error
from services.common.k8s_jobs import K8sLaunchConfig
from services.common.k8s_status import metrics_record, pod_outcome
from services.trainer.k8s_launcher import (
    KubernetesLauncher,
    in_cluster,
    select_launcher,
    use_kubernetes,
)
from tests.k8s.fake_cluster import FakeCluster, done, pod, running


def test_pod_outcome_maps_pod_states():
    assert pod_outcome([], 2).state == "pending"
    assert pod_outcome([running("p-0")], 2).state == "pending"
    assert pod_outcome([running("p-0"), running("p-1")], 2).state == "running"
    assert pod_outcome([done("p-0"), running("p-1")], 2).state == "running"
    assert pod_outcome([done("p-0"), done("p-1")], 2).state == "succeeded"
    failed = pod_outcome([done("p-0", 3, "Error"), running("p-1")], 2)
    assert (failed.state, failed.exit_code, failed.error) == ("failed", 3, None)
    assert "p-0" in failed.message and "code 3" in failed.message
    oom = pod_outcome([done("p-1", 137, "OOMKilled"), done("p-0", 1, "Error")], 2)
    assert oom.error is ResourceExhausted and "MESHLINE_K8S_WORKER_MEMORY" in oom.message
    pull = pod_outcome(
        [pod("p-0", "Pending", waiting={"reason": "ImagePullBackOff", "message": "no"})], 1
    )
    assert pull.error is FailedPrecondition and "ImagePullBackOff" in pull.message
    evicted = pod_outcome([pod("p-0", "Failed", reason="Evicted", message="low memory")], 1)
    assert evicted.error is Unavailable and "evicted" in evicted.message
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/3 nodes have nvidia.com/gpu"}  # fmt: skip
    pending = pod_outcome([pod("p-0", "Pending", conditions=[unschedulable])], 1)
    assert pending.state == "pending" and pending.unschedulable
    assert "nvidia.com/gpu" in pending.message
    creating = pod("p-0", "Pending", waiting={"reason": "ContainerCreating"})
    assert pod_outcome([creating], 1).error is None


def test_metrics_record_reads_only_metrics_lines():
    nonce = "0123456789abcdef"
    framed = f'MESHLINE_METRICS {nonce} {{"step": 10, "loss": 2.5}}'
    assert metrics_record(framed, nonce) == {"step": 10, "loss": 2.5}
    # #37: unframed or wrongly framed lines (user data echoed in a pod's log) are not records.
    assert metrics_record('MESHLINE_METRICS {"step": 10, "loss": 2.5}', nonce) is None
    assert metrics_record(framed.replace(nonce, "f" * 16), nonce) is None
    assert metrics_record("step 10 | loss 2.5", nonce) is None
    assert metrics_record(f"MESHLINE_METRICS {nonce} {{broken", nonce) is None
    assert metrics_record(f'MESHLINE_METRICS {nonce} {{"loss": 1}}', nonce) is None


def test_launcher_choice(tmp_path: Path, monkeypatch):
    (tmp_path / "token").write_text("t")
    assert in_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, tmp_path)
    assert not in_cluster({}, tmp_path)
    assert not in_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, tmp_path / "none")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert not use_kubernetes("auto") and not use_kubernetes("local")
    assert use_kubernetes("kubernetes")
    with pytest.raises(ValueError, match="--launcher"):
        use_kubernetes("slurm")
    from services.trainer.launcher import launch

    assert select_launcher("auto", "operations/train-1") is launch


def _launcher(cluster, **config):
    return KubernetesLauncher(K8sLaunchConfig(poll_s=0.01, **config), cluster, "meshline:test")


def test_launch_creates_the_workload_streams_metrics_and_succeeds():
    logs = {
        "p-0": ["rank 0 starting", 'METRICS:{"step": 5, "loss": 3.0}',
                'MESHLINE_METRICS {"step": 99999, "loss": 0.1}',  # echoed, not framed
                'METRICS:{"step": 10, "loss": 2.0}', "done"],
        "p-1": ["rank 1 starting"],
    }  # fmt: skip
    cluster = FakeCluster(
        [[], [running("p-0")], [running("p-0"), running("p-1")], [done("p-0"), done("p-1")]],
        logs,
    )
    records, out = [], io.StringIO()
    code = _launcher(cluster).launch(
        ["--mock-data"], 2, nnodes=2, on_metrics=records.append, output=out,
        operation="operations/train-abc123",
    )  # fmt: skip
    assert code == 0
    assert [o["kind"] for o in cluster.created] == ["Service", "Job"]
    job = cluster.created[-1]
    assert job["metadata"]["name"] == "meshline-train-abc123"
    assert job["spec"]["completions"] == 2
    assert cluster.owners == [("meshline-train-abc123", "uid-1")], "the Job owns its Service"
    assert [r["step"] for r in records] == [5, 10]
    text = out.getvalue()
    assert "[p-0] rank 0 starting" in text and "[p-1] rank 1 starting" in text
    # The echoed unframed line is output; no framed line is.
    assert '[p-0] MESHLINE_METRICS {"step": 99999' in text
    assert f"MESHLINE_METRICS {cluster.metrics_nonce()}" not in text
    assert not cluster.stopped


def test_a_worker_failure_returns_its_exit_code_and_stops_the_rest():
    cluster = FakeCluster(
        [[running("p-0"), running("p-1")], [done("p-0", 2, "Error"), running("p-1")]]
    )
    out = io.StringIO()
    assert (
        _launcher(cluster).launch(["--x"], 1, nnodes=2, output=out, operation="operations/train-f")
        == 2
    )
    assert cluster.stopped == ["meshline-train-f"]
    assert "worker exited with code 2" in out.getvalue()


@pytest.mark.parametrize(
    ("pods", "error", "words"),
    [
        ([done("p-0", 137, "OOMKilled")], ResourceExhausted, "OOMKilled"),
        (
            [pod("p-0", "Pending", waiting={"reason": "ErrImagePull"})],
            FailedPrecondition,
            "ErrImagePull",
        ),
        ([pod("p-0", "Failed", reason="Evicted")], Unavailable, "evicted"),
    ],
)
def test_cluster_failures_fail_the_operation_with_their_code(pods, error, words):
    cluster = FakeCluster([pods])
    with pytest.raises(error, match=words):
        _launcher(cluster).launch(["--x"], 1, output=io.StringIO(), operation="operations/train-e")
    assert cluster.stopped == ["meshline-train-e"]


def test_a_job_that_stays_unschedulable_fails_resource_exhausted():
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "Insufficient huawei.com/Ascend910"}  # fmt: skip
    cluster = FakeCluster([[pod("p-0", "Pending", conditions=[condition])]])
    launcher = _launcher(cluster, schedule_timeout_s=0.05, job_kind="volcano", accelerator="ascend")
    with pytest.raises(ResourceExhausted, match=r"Ascend910.*MESHLINE_K8S_SCHEDULE_TIMEOUT"):
        launcher.launch(["--x"], 8, nnodes=2, output=io.StringIO(), operation="operations/train-u")
    assert cluster.stopped == ["meshline-train-u"]
    assert cluster.created[-1]["kind"] == "Job" and cluster.created[-1]["spec"]["minAvailable"] == 2


def test_stop_suspends_the_workload_and_returns_once_its_pods_are_gone():
    stop = threading.Event()
    stop.set()
    cluster = FakeCluster([[running("p-0")]], after_stop=[])
    out = io.StringIO()
    code = _launcher(cluster, job_kind="pytorchjob", accelerator="gpu").launch(
        ["--save", "/data/c"], 8, stop_event=stop, output=out, operation="operations/train-s"
    )
    assert code == 0 and cluster.stopped == ["meshline-train-s"]
    assert cluster.created[-1]["kind"] == "PyTorchJob"
    assert "stopping meshline-train-s" in out.getvalue()


def test_a_dropped_log_stream_is_reopened_and_steps_pass_once():
    metrics = [
        'METRICS:{"step": 5, "loss": 3.0}',
        'METRICS:{"step": 10, "loss": 2.0}',
    ]
    cluster = FakeCluster(
        [[running("p-0")], [running("p-0")], [running("p-0")], [done("p-0")]],
        logs={"p-0": [[metrics[0]], metrics]},
    )
    records = []
    code = _launcher(cluster).launch(
        ["--x"], 1, on_metrics=records.append, output=io.StringIO(), operation="operations/train-r"
    )
    assert code == 0
    assert [r["step"] for r in records] == [5, 10]
    opens = [since for pod, since in cluster.log_opens if pod == "p-0"]
    assert opens[0] is None and opens[1] is not None and opens[1] >= 5


def test_a_briefly_unreachable_api_server_is_waited_out(monkeypatch):
    cluster = FakeCluster([[running("p-0")], [done("p-0")]])
    cluster.list_failures = 3
    assert (
        _launcher(cluster).launch(["--x"], 1, output=io.StringIO(), operation="operations/train-a")
        == 0
    )
    monkeypatch.setattr("services.trainer.k8s_launcher.MAX_POLL_ERRORS", 2)
    cluster = FakeCluster([[running("p-0")]])
    cluster.list_failures = 5
    with pytest.raises(Unavailable, match="cannot read the pods of meshline-train-b"):
        _launcher(cluster).launch(["--x"], 1, output=io.StringIO(), operation="operations/train-b")


@pytest.mark.parametrize(
    ("status", "error", "words"),
    [
        (403, FailedPrecondition, "service account"),
        (404, FailedPrecondition, "install Volcano"),
        (409, Conflict, "exists"),
        (422, FailedPrecondition, "rejected"),
        (500, Unavailable, "retry"),
    ],
)
def test_api_refusals_become_operation_errors(status, error, words):
    body = json.dumps({"kind": "Status", "message": 'jobs.batch is forbidden: User "x"'})
    exc = api_error(status, body, "create Job meshline-train-1 in research")
    assert isinstance(exc, error) and words in exc.message
    expected = f"create Job meshline-train-1 in research: HTTP {status}: jobs.batch is forbidden"
    assert expected in exc.message
    assert "plain text" in api_error(500, "plain text", "x").message


def test_a_refused_job_leaves_no_service_behind():
    cluster = FakeCluster([[]])
    cluster.refuse["Job"] = Conflict("create Job meshline-train-c in research: HTTP 409: exists")
    with pytest.raises(Conflict, match="409"):
        _launcher(cluster).launch(
            ["--x"], 1, nnodes=2, output=io.StringIO(), operation="operations/train-c"
        )
    assert [o["kind"] for o in cluster.created] == ["Service"]
    assert cluster.deleted_services == ["meshline-train-c"]
