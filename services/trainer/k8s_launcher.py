"""The trainer service's launcher inside a Kubernetes cluster.

`KubernetesLauncher.launch` takes the arguments of `services.trainer.launcher.launch` (the local
torchrun launcher) and runs the job as a workload built by `services.common.k8s_jobs`: it
creates the objects, follows the worker pods (their state every `poll_s`, their logs as
streams: `MESHLINE_METRICS <nonce> {json}` lines, framed with the job's own random nonce,
become metrics records, other lines go to `output`),
stops the workload when `stop_event` is set (its pods get SIGTERM; the workers save to --save
first) and maps pod failures to the operation's outcome (`pod_outcome`): a worker's non-zero
exit is returned as the exit code; OOM kills, unpullable images, evictions and jobs that stay
unschedulable raise the matching MeshlineError. `select_launcher` picks this launcher inside a
cluster and the local one elsewhere.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from services.common.errors import FailedPrecondition, MeshlineError, ResourceExhausted, Unavailable
from services.common.k8s_client import KubeClient
from services.common.k8s_jobs import (
    K8sLaunchConfig,
    TrainingJobSpec,
    build_training_objects,
    job_name,
)
from services.common.k8s_status import metrics_record, pod_outcome
from services.common.state_db import ProcessRecord
from services.trainer.config import LAUNCHERS
from services.trainer.launcher import launch

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# After a stop, pods get the template's terminationGracePeriodSeconds (120 s) to save and exit.
STOP_WAIT_S = 180.0
# Consecutive failed looks at the pods (API server unreachable) before the job is given up.
MAX_POLL_ERRORS = 30


def in_cluster(environ: dict[str, str] | None = None, sa_dir: Path = SA_DIR) -> bool:
    """Whether this process runs in a Kubernetes pod with a service-account token."""
    env = os.environ if environ is None else environ
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and (sa_dir / "token").is_file()


def use_kubernetes(choice: str) -> bool:
    """Whether the launcher setting `choice` (auto, local, kubernetes) means the k8s launcher."""
    if choice not in LAUNCHERS:
        raise ValueError(f"--launcher must be one of {LAUNCHERS}, got {choice!r}")
    return choice == "kubernetes" or (choice == "auto" and in_cluster())


def select_launcher(choice: str, operation: str) -> Callable[..., int]:
    """`launch(config_or_argv, nproc_per_node, **options) -> exit code` for the setting."""
    if use_kubernetes(choice):
        return functools.partial(KubernetesLauncher.in_cluster().launch, operation=operation)
    return launch


class KubernetesLauncher:
    """Runs training jobs as cluster workloads and follows them to the end."""

    def __init__(self, config: K8sLaunchConfig, client: Any, image: str) -> None:
        self.config = config
        self.client = client
        self.image = image

    @classmethod
    def in_cluster(cls) -> KubernetesLauncher:
        """The launcher of the trainer pod: its namespace, its image, config from the env."""
        try:
            config = K8sLaunchConfig.from_env()
        except ValueError as exc:
            raise FailedPrecondition(f"trainer's Kubernetes launcher settings: {exc}") from exc
        namespace = config.namespace or (SA_DIR / "namespace").read_text().strip()
        client = KubeClient(namespace)
        image = config.image
        if not image:
            pod = client.own_pod()
            if pod is None:
                raise FailedPrecondition(
                    "the trainer cannot read its own pod to find its image; set "
                    "MESHLINE_K8S_IMAGE or POD_NAME (downward API)"
                )
            image = pod["spec"]["containers"][0]["image"]
        return cls(config, client, image)

    def launch(
        self,
        config: list[str],
        nproc_per_node: int = 1,
        *,
        nnodes: int = 1,
        max_restarts: int = 0,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
        stop_event: threading.Event | None = None,
        env: dict[str, str] | None = None,
        output: TextIO | None = None,
        save_on_stop: bool | Callable[[], bool] = True,
        operation: str = "",
        on_started: Callable[[ProcessRecord], None] | None = None,
        **ignored: Any,
    ) -> int:
        """Runs the job with training flags `config`; returns 0 or a worker's exit code.

        Raises ResourceExhausted / FailedPrecondition / Unavailable when the cluster, not the
        training, ended it. `node_rank` and `rdzv_endpoint` of the local launcher are set per
        pod by the workload and so are ignored here. Pods are stopped with SIGTERM, so a stop
        saves unless `save_on_stop` is False at launch (a callable cannot change that later).
        `on_started` gets the workload's record (`workload_record`), so that a restarted
        trainer stops it (`stop_recorded_workload`).
        """
        out = output or sys.stdout
        spec = TrainingJobSpec(
            name=job_name(operation or f"train-{int(time.time())}"),
            args=tuple(config),
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            max_restarts=max_restarts,
            env=tuple(sorted((env or {}).items())),
            image=self.image,
            save_on_stop=save_on_stop is not False,
            operation=operation,
            namespace=self.client.namespace,
        )
        objects = build_training_objects(spec, self.config)
        workload = self._create(objects, out)
        if on_started is not None:
            on_started(workload_record(operation, workload, self.client.namespace))
        out.write(f"created {workload['kind']} {spec.name} ({nnodes} x {nproc_per_node})\n")
        return _Follower(self, spec, workload, on_metrics, out).run(stop_event)

    def _create(self, objects: list[dict[str, Any]], out: TextIO) -> dict[str, Any]:
        """Creates the Services, then the workload, then makes the workload own them."""
        *services, workload = objects
        for service in services:
            self.client.create(service)
        try:
            made = self.client.create(workload)
        except MeshlineError:
            for service in services:
                self.client.delete_service(service["metadata"]["name"])
            raise
        for service in services:
            name = service["metadata"]["name"]
            try:
                self.client.set_owner(name, made)
            except Exception as exc:  # the job runs regardless; only the clean-up is manual
                out.write(f"Service {name} stays after the job ({type(exc).__name__}: {exc})\n")
        return made


def workload_record(operation: str, workload: dict[str, Any], namespace: str) -> ProcessRecord:
    """The `processes` row of a workload: its apiVersion, kind and name as the token."""
    meta = workload["metadata"]
    token = f"{workload['apiVersion']} {workload['kind']} {meta['name']}"
    return ProcessRecord(operation, "kubernetes", 0, 0, 0.0, token, namespace)


def stop_recorded_workload(record: ProcessRecord) -> str:
    """Stops the workload of a job whose trainer died (the `kubernetes` stopper of the store).

    Its pods get SIGTERM and save to --save first, as on StopTraining.
    """
    api_version, kind, name = record.token.split(" ", 2)
    launcher = KubernetesLauncher.in_cluster()
    launcher.client.stop({"apiVersion": api_version, "kind": kind, "metadata": {"name": name}})
    return f"its {kind} {name} was stopped (its pods save to --save first)"


class _Follower:
    """Follows one workload's pods and logs until it ends."""

    def __init__(
        self,
        launcher: KubernetesLauncher,
        spec: TrainingJobSpec,
        workload: dict[str, Any],
        on_metrics: Callable[[dict[str, Any]], None] | None,
        out: TextIO,
    ) -> None:
        self.launcher, self.spec, self.workload = launcher, spec, workload
        self.on_metrics, self.out = on_metrics, out
        self.lock = threading.Lock()
        self.streams: dict[str, threading.Thread] = {}
        self.stream_ended: dict[str, float] = {}
        self.last_step = -1

    def _write(self, line: str) -> None:
        with self.lock:
            self.out.write(line + "\n")

    def _stream(self, pod: str, container: str, since_s: int | None) -> None:
        try:
            for line in self.launcher.client.follow_log(pod, container, since_s):
                record = metrics_record(line, self.spec.metrics_nonce)
                if record is None:
                    self._write(f"[{pod}] {line}")
                    continue
                with self.lock:
                    # A reopened stream may repeat lines; each logged step is passed on once.
                    fresh = record["step"] > self.last_step
                    self.last_step = max(self.last_step, record["step"])
                if fresh and self.on_metrics is not None:
                    self.on_metrics(record)
        except Exception as exc:  # the job's state comes from the pods; a lost log is noted
            self._write(f"[{pod}] log stream broke: {type(exc).__name__}: {exc}")
        self.stream_ended[pod] = time.monotonic()

    def _follow_logs(self, pods: list[dict[str, Any]]) -> None:
        """Opens a log stream per started pod, reopening one that ended while its pod runs."""
        for pod in pods:
            name = pod["metadata"]["name"]
            states = [
                c.get("state") or {}
                for c in (pod.get("status") or {}).get("containerStatuses") or []
            ]
            running = any("running" in state for state in states)
            started = running or any("terminated" in state for state in states)
            since_s = None
            if name in self.streams:
                if self.streams[name].is_alive() or not running or name not in self.stream_ended:
                    continue
                # The API server dropped the stream of a live pod: reopen from shortly before.
                since_s = int(time.monotonic() - self.stream_ended[name]) + 5
            if started:
                container = pod["spec"]["containers"][0]["name"]
                thread = threading.Thread(
                    target=self._stream, args=(name, container, since_s), daemon=True
                )
                self.streams[name] = thread
                thread.start()

    def _join_logs(self) -> None:
        for thread in self.streams.values():
            thread.join(timeout=30)

    def run(self, stop_event: threading.Event | None) -> int:
        """Polls the pods until the job ends; see KubernetesLauncher.launch."""
        config, client = self.launcher.config, self.launcher.client
        unschedulable_since: float | None = None
        stop_deadline: float | None = None
        last_message = ""
        errors = 0
        while True:
            try:
                pods = client.list_pods(self.spec.name)
                errors = 0
            except Exception as exc:  # a busy or restarting API server: look again next poll
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    raise Unavailable(
                        f"cannot read the pods of {self.spec.name} ({type(exc).__name__}: "
                        f"{exc}); the workload may still run: check it with kubectl"
                    ) from exc
                time.sleep(config.poll_s)
                continue
            self._follow_logs(pods)
            outcome = pod_outcome(pods, self.spec.nnodes)
            if outcome.message and outcome.message != last_message:
                self._write(outcome.message)
                last_message = outcome.message
            if stop_deadline is not None:
                active = [p for p in pods if p["status"].get("phase") in ("Pending", "Running")]
                if not active or time.monotonic() > stop_deadline:
                    self._join_logs()
                    return 0
            elif outcome.state == "succeeded":
                self._join_logs()
                return 0
            elif outcome.state == "failed":
                client.stop(self.workload)
                self._join_logs()
                if outcome.error is not None:
                    raise outcome.error(outcome.message)
                return outcome.exit_code or 1
            elif stop_event is not None and stop_event.is_set():
                self._write(f"stopping {self.spec.name}: workers save and exit")
                client.stop(self.workload)
                stop_deadline = time.monotonic() + STOP_WAIT_S
            if outcome.unschedulable:
                unschedulable_since = unschedulable_since or time.monotonic()
                if time.monotonic() - unschedulable_since > config.schedule_timeout_s:
                    client.stop(self.workload)
                    raise ResourceExhausted(
                        f"{outcome.message} for over {config.schedule_timeout_s:g} s; ask for "
                        "fewer nodes or devices, or free capacity (MESHLINE_K8S_SCHEDULE_TIMEOUT)"
                    )
            else:
                unschedulable_since = None
            time.sleep(config.poll_s)
