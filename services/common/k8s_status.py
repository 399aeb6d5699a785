"""What a training workload's pods say: their state mapped to the operation's outcome, and the
metrics records in their logs (`services.trainer.k8s_launcher` follows workloads with these)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common.errors import FailedPrecondition, MeshlineError, ResourceExhausted, Unavailable

METRICS_PREFIX = "MESHLINE_METRICS "
MAX_METRICS_LINE = 1 << 16
# Container waiting reasons that never resolve by themselves.
_CONFIG_ERRORS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
     "CreateContainerError", "RunContainerError"}
)  # fmt: skip


@dataclass(frozen=True)
class PodOutcome:
    """What the worker pods say about the job."""

    state: str
    """pending, running, succeeded or failed."""
    message: str = ""
    """Why, naming the pod (empty while all is well)."""
    exit_code: int | None = None
    """A worker's non-zero exit code when the training itself failed."""
    error: type[MeshlineError] | None = None
    """The error class when the cluster, not the training, failed the job."""
    unschedulable: bool = False
    """Whether some pod cannot be placed on any node (yet)."""


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def pod_outcome(pods: list[dict[str, Any]], nnodes: int) -> PodOutcome:
    """The job's state from its worker pods (manifest-shaped dicts, as the API returns them).

    Cluster failures come first (they explain a worker's exit): OOM kill → RESOURCE_EXHAUSTED,
    eviction → UNAVAILABLE, an image or container config error → FAILED_PRECONDITION. Then a
    worker's non-zero exit; then success once `nnodes` pods have succeeded.
    """
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for container in _containers(pod):
            state = container.get("state") or {}
            term, wait = state.get("terminated") or {}, state.get("waiting") or {}
            if term.get("reason") == "OOMKilled":
                return PodOutcome(
                    "failed",
                    f"pod {name}: container {container['name']} was killed for using more "
                    "memory than its limit (OOMKilled); raise MESHLINE_K8S_WORKER_MEMORY or "
                    "lower --micro-batch-size",
                    error=ResourceExhausted,
                )
            if wait.get("reason") in _CONFIG_ERRORS:
                return PodOutcome(
                    "failed",
                    f"pod {name}: container {container['name']} cannot start: {wait['reason']}: "
                    f"{wait.get('message', '')} (check the image name, pull secret and config)",
                    error=FailedPrecondition,
                )
        if status.get("phase") == "Failed" and status.get("reason") in ("Evicted", "Preempted"):
            return PodOutcome(
                "failed",
                f"pod {name} was {status['reason'].lower()} by the cluster: "
                f"{status.get('message', '')}; start the job again",
                error=Unavailable,
            )
    for pod in pods:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (container.get("state") or {}).get("terminated") or {}
            if term.get("exitCode"):
                return PodOutcome(
                    "failed",
                    f"pod {pod['metadata']['name']}: worker exited with code {term['exitCode']} "
                    f"({term.get('reason', 'Error')}); its log is above",
                    exit_code=int(term["exitCode"]),
                )
    phases = [(pod.get("status") or {}).get("phase", "Pending") for pod in pods]
    if len(pods) >= nnodes and all(phase == "Succeeded" for phase in phases):
        return PodOutcome("succeeded")
    for pod in pods:
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("reason") == "Unschedulable"
            ):
                return PodOutcome(
                    "pending",
                    f"pod {pod['metadata']['name']} is unschedulable: {condition.get('message', '')}",
                    unschedulable=True,
                )
    if len(pods) >= nnodes and all(phase in ("Running", "Succeeded") for phase in phases):
        return PodOutcome("running")
    return PodOutcome("pending", f"{phases.count('Running')}/{nnodes} worker pods running")


def metrics_record(line: str, nonce: str) -> dict[str, Any] | None:
    """The metrics record of a `MESHLINE_METRICS <nonce> {json}` log line, else None (any other
    line, an unframed or wrongly framed one included, is output)."""
    prefix = f"{METRICS_PREFIX}{nonce} "
    if not line.startswith(prefix) or len(line) > MAX_METRICS_LINE:
        return None
    try:
        record = json.loads(line[len(prefix) :])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "step" in record else None
