"""Training workloads as Kubernetes manifests, built from the templates under `k8s/training/`.

`build_training_objects` turns a job (name, training flags, nodes, processes per node, extra
environment) into manifests built from the same files the kustomize overlays apply, for one of
three workload kinds: an Indexed Job with a headless Service and torchrun's c10d rendezvous
(`indexed`), a gang-scheduled Volcano Job with static rendezvous and explicit node ranks
(`volcano`, Ascend clusters) or a Kubeflow PyTorchJob (`pytorchjob`). The accelerator profile
(`cpu`, `gpu`, `ascend`) adds the device resource and the collective's environment. The
launcher that creates and follows them is `services.trainer.k8s_launcher`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

JOB_KINDS = ("indexed", "volcano", "pytorchjob")
JOB_LABEL = "meshline.dev/train-job"
OPERATION_ANNOTATION = "meshline.dev/operation"
TRAIN_MODULE = "services.trainer.train"
_TEMPLATE_FILES = {
    "indexed": ("service.yaml", "job.yaml"),
    "volcano": ("job.yaml",),
    "pytorchjob": ("job.yaml",),
}
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _default_template_dir() -> str:
    return os.environ.get(
        "MESHLINE_K8S_TEMPLATES", str(Path(__file__).resolve().parents[2] / "k8s" / "training")
    )


@dataclass(frozen=True)
class Accelerator:
    """What a worker pod of one device type asks for and sets."""

    resource: str | None
    """Extended resource per device (`nvidia.com/gpu`), None on CPU."""
    env: tuple[dict[str, Any], ...] = ()
    """Environment entries (Kubernetes EnvVar objects) of every worker container."""


ACCELERATORS: dict[str, Accelerator] = {
    "cpu": Accelerator(None, ({"name": "OMP_NUM_THREADS", "value": "1"},)),
    "gpu": Accelerator(
        "nvidia.com/gpu",
        (
            {"name": "NCCL_DEBUG", "value": "WARN"},
            {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "3"},
        ),
    ),
    "ascend": Accelerator(
        "huawei.com/Ascend910",
        (
            {"name": "HCCL_IF_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HCCL_SOCKET_IFNAME", "value": "eth0"},
            {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
            # Seconds HCCL waits for every rank to connect, and for one collective to finish:
            # 8-NPU nodes take minutes to come up, and a pipeline stage can wait long on a peer.
            {"name": "HCCL_CONNECT_TIMEOUT", "value": "1200"},
            {"name": "HCCL_EXEC_TIMEOUT", "value": "1800"},
            {"name": "HCCL_WHITELIST_DISABLE", "value": "1"},
            {"name": "PYTORCH_NPU_ALLOC_CONF", "value": "expandable_segments:True"},
            {"name": "CUDA_DEVICE_MAX_CONNECTIONS", "value": "1"},
            {"name": "ASCEND_PROCESS_LOG_PATH", "value": "/tmp/ascend-log"},
        ),
    ),
}


@dataclass
class K8sLaunchConfig:
    """Where and how the trainer service runs training workloads (`MESHLINE_K8S_*` variables)."""

    job_kind: str = "indexed"
    """Workload kind: indexed (Job + headless Service), volcano, pytorchjob."""
    accelerator: str = "cpu"
    """Device profile of the workers: cpu, gpu, ascend."""
    namespace: str | None = None
    """Namespace of the workloads; None = the trainer pod's own."""
    image: str | None = None
    """Worker image; None = the trainer pod's own image."""
    data_claim: str = "meshline-data"
    """PersistentVolumeClaim mounted at /data in every worker."""
    worker_cpu: str = "2"
    """CPU request of a worker pod (the limit is twice it)."""
    worker_memory: str = "4Gi"
    """Memory request and limit of a worker pod."""
    shm_size: str = "1Gi"
    """Size of the in-memory /dev/shm of a worker pod."""
    volcano_queue: str = "default"
    """Volcano queue of volcano jobs."""
    cluster_domain: str = "cluster.local"
    """DNS domain of the cluster (pod names are <pod>.<service>.<namespace>.svc.<domain>)."""
    rdzv_port: int = 29400
    """Port of the c10d rendezvous store (indexed) or the master (volcano)."""
    schedule_timeout_s: float = 900.0
    """Seconds a job may stay unschedulable before it fails RESOURCE_EXHAUSTED."""
    poll_s: float = 2.0
    """Seconds between two looks at the worker pods."""
    template_dir: str = field(default_factory=_default_template_dir)
    """Directory holding the indexed/, volcano/ and pytorchjob/ templates."""

    def __post_init__(self) -> None:
        if self.job_kind not in JOB_KINDS:
            raise ValueError(
                f"MESHLINE_K8S_JOB_KIND must be one of {JOB_KINDS}, got {self.job_kind!r}"
            )
        if self.accelerator not in ACCELERATORS:
            raise ValueError(
                f"MESHLINE_K8S_ACCELERATOR must be one of {tuple(ACCELERATORS)}, "
                f"got {self.accelerator!r}"
            )
        if not 1 <= self.rdzv_port <= 65535:
            raise ValueError(f"MESHLINE_K8S_RDZV_PORT must be in [1, 65535], got {self.rdzv_port}")
        if self.schedule_timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError("MESHLINE_K8S_SCHEDULE_TIMEOUT and MESHLINE_K8S_POLL must be > 0")
        if not (Path(self.template_dir) / self.job_kind).is_dir():
            raise ValueError(
                f"MESHLINE_K8S_TEMPLATES {self.template_dir!r} has no {self.job_kind}/ template "
                "directory; point it at the repository's k8s/training"
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> K8sLaunchConfig:
        """The config from `MESHLINE_K8S_<FIELD>` variables (unset ones keep their default)."""
        env = os.environ if environ is None else environ
        names = {"schedule_timeout_s": "SCHEDULE_TIMEOUT", "poll_s": "POLL", "template_dir": None}
        values: dict[str, Any] = {}
        for name, kind in cls.__annotations__.items():
            key = names.get(name, name.upper())
            raw = env.get(f"MESHLINE_K8S_{key}") if key else None
            if not raw:
                continue
            try:
                values[name] = int(raw) if kind == "int" else float(raw) if kind == "float" else raw
            except ValueError:
                raise ValueError(f"MESHLINE_K8S_{key}={raw!r} is not a number") from None
        if env.get("MESHLINE_K8S_TEMPLATES"):
            values["template_dir"] = env["MESHLINE_K8S_TEMPLATES"]
        return cls(**values)


@dataclass(frozen=True)
class TrainingJobSpec:
    """One training job: what the workers run and how many there are."""

    name: str
    """Workload name (DNS label, at most 40 characters so pod host names fit)."""
    args: tuple[str, ...]
    """Flags of `services.trainer.train`."""
    nnodes: int = 1
    """Worker pods (one torchrun agent each)."""
    nproc_per_node: int = 1
    """Worker processes (devices) per pod."""
    max_restarts: int = 0
    """torchrun restarts of the workers inside the pods."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the workers."""
    image: str = "meshline"
    """Worker image."""
    save_on_stop: bool = True
    """Whether stopped workers save to --save first."""
    operation: str = ""
    """Name of the operation the job belongs to (an annotation)."""
    namespace: str = ""
    """Namespace the job runs in (for the pods' full DNS names); "" = short names."""
    metrics_nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    """Frames rank 0's metrics lines (`MESHLINE_METRICS <nonce> {json}`, via
    $MESHLINE_METRICS_STDOUT); fresh per job, so data echoed in a pod's log cannot forge one."""

    def __post_init__(self) -> None:
        if re.fullmatch(r"[0-9a-f]{16,64}", self.metrics_nonce) is None:
            raise ValueError(
                f"metrics_nonce must be 16-64 lower-case hex digits, not {self.metrics_nonce!r}"
            )
        if len(self.name) > 40 or _DNS_LABEL.fullmatch(self.name) is None:
            raise ValueError(
                f"job name {self.name!r} must be a DNS label of at most 40 characters "
                "(lower case letters, digits, '-'; starting with a letter)"
            )
        if self.nnodes < 1 or self.nproc_per_node < 1 or self.max_restarts < 0:
            raise ValueError(
                f"nnodes ({self.nnodes}) and nproc_per_node ({self.nproc_per_node}) must be >= 1, "
                f"max_restarts ({self.max_restarts}) >= 0"
            )


def job_name(operation: str) -> str:
    """Workload name of an operation: `operations/train-2f1c9a...` -> `meshline-train-2f1c9a...`."""
    suffix = re.sub(r"[^a-z0-9-]", "-", operation.rsplit("/", 1)[-1].lower()).strip("-")
    return f"meshline-{suffix}"[:40].rstrip("-")


def load_template(template_dir: str | Path, job_kind: str) -> list[dict[str, Any]]:
    """The manifests of one workload kind's template, as plain dicts."""
    folder = Path(template_dir) / job_kind
    docs: list[dict[str, Any]] = []
    for filename in _TEMPLATE_FILES[job_kind]:
        docs += [d for d in yaml.safe_load_all((folder / filename).read_text()) if d]
    # YAML anchors share one object between replicas, and deepcopy would keep that sharing; a
    # JSON round trip gives every pod template its own copy.
    return json.loads(json.dumps(docs))


def _set_env(container: dict[str, Any], entries: Iterable[dict[str, Any]]) -> None:
    """Sets each entry in place (order matters: `$(VAR)` may only name earlier entries)."""
    env = container.setdefault("env", [])
    for entry in entries:
        names = [e["name"] for e in env]
        if entry["name"] in names:
            env[names.index(entry["name"])] = dict(entry)
        else:
            env.append(dict(entry))


def _escape(arg: str) -> str:
    # Kubernetes expands $(VAR) in args; a training flag is meant literally.
    return arg.replace("$(", "$$(")


def _configure_pod(
    pod: dict[str, Any], spec: TrainingJobSpec, config: K8sLaunchConfig, env: list[dict]
) -> None:
    """Sets the parts every workload kind shares on one pod template."""
    metadata = pod.setdefault("metadata", {})
    metadata.setdefault("labels", {})[JOB_LABEL] = spec.name
    if spec.operation:
        metadata.setdefault("annotations", {})[OPERATION_ANNOTATION] = spec.operation
    container = pod["spec"]["containers"][0]
    container["image"] = spec.image
    args = container["args"]
    container["args"] = args[: args.index(TRAIN_MODULE) + 1] + [_escape(a) for a in spec.args]
    accelerator = ACCELERATORS[config.accelerator]
    base_env = [
        {"name": "JOB_NAME", "value": spec.name},
        {"name": "MAX_RESTARTS", "value": str(spec.max_restarts)},
        {"name": "MESHLINE_METRICS_STDOUT", "value": spec.metrics_nonce},
        {"name": "MESHLINE_SAVE_ON_STOP", "value": "1" if spec.save_on_stop else "0"},
    ]
    user_env = [{"name": k, "value": v} for k, v in spec.env]
    _set_env(container, [*base_env, *env, *accelerator.env, *user_env])
    limits_cpu = _double_cpu(config.worker_cpu)
    requests = {"cpu": config.worker_cpu, "memory": config.worker_memory}
    limits = {"cpu": limits_cpu, "memory": config.worker_memory}
    if accelerator.resource:
        requests[accelerator.resource] = limits[accelerator.resource] = str(spec.nproc_per_node)
    container["resources"] = {"requests": requests, "limits": limits}
    for volume in pod["spec"].get("volumes", []):
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"]["claimName"] = config.data_claim
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            volume["emptyDir"]["sizeLimit"] = config.shm_size


def _double_cpu(quantity: str) -> str:
    if quantity.endswith("m") and quantity[:-1].isdigit():
        return f"{2 * int(quantity[:-1])}m"
    try:
        return f"{2 * float(quantity):g}"
    except ValueError as exc:
        raise ValueError(
            f"MESHLINE_K8S_WORKER_CPU {quantity!r} is not a CPU quantity (e.g. 4 or 500m)"
        ) from exc


def _pod_fqdn(host: str, spec: TrainingJobSpec, config: K8sLaunchConfig) -> str:
    """DNS name of a pod with this host name under the job's headless Service."""
    if not spec.namespace:
        return f"{host}.{spec.name}"
    return f"{host}.{spec.name}.{spec.namespace}.svc.{config.cluster_domain}"


def _build_indexed(docs: list[dict], spec: TrainingJobSpec, config: K8sLaunchConfig) -> None:
    service, job = docs
    for obj in docs:
        obj["metadata"]["name"] = spec.name
        obj["metadata"].setdefault("labels", {})[JOB_LABEL] = spec.name
    service["spec"]["selector"] = {JOB_LABEL: spec.name}
    service["spec"]["ports"][0]["port"] = service["spec"]["ports"][0]["targetPort"] = (
        config.rdzv_port
    )
    job["spec"]["completions"] = job["spec"]["parallelism"] = spec.nnodes
    pod = job["spec"]["template"]
    pod["spec"]["subdomain"] = spec.name
    pod["spec"]["containers"][0]["ports"] = [
        {"name": "rendezvous", "containerPort": config.rdzv_port}
    ]
    env = [
        {"name": "NNODES", "value": str(spec.nnodes)},
        {"name": "NPROC_PER_NODE", "value": str(spec.nproc_per_node)},
        # Pod 0 hosts the c10d store. Its full name is in its own /etc/hosts, so it knows
        # itself as the host before the headless Service's DNS record exists.
        {
            "name": "RDZV_ENDPOINT",
            "value": f"{_pod_fqdn(f'{spec.name}-0', spec, config)}:{config.rdzv_port}",
        },
    ]
    _configure_pod(pod, spec, config, env)


def _build_volcano(docs: list[dict], spec: TrainingJobSpec, config: K8sLaunchConfig) -> None:
    (job,) = docs
    job["metadata"]["name"] = spec.name
    job["metadata"].setdefault("labels", {})[JOB_LABEL] = spec.name
    job["spec"]["minAvailable"] = spec.nnodes
    job["spec"]["queue"] = config.volcano_queue
    task = job["spec"]["tasks"][0]
    task["replicas"] = spec.nnodes
    env = [
        {"name": "NNODES", "value": str(spec.nnodes)},
        {"name": "NPROC_PER_NODE", "value": str(spec.nproc_per_node)},
        # Volcano's svc plugin names pods <job>-<task>-<index> under the job's headless Service.
        {"name": "MASTER_ADDR", "value": _pod_fqdn(f"{spec.name}-{task['name']}-0", spec, config)},
        {"name": "MASTER_PORT", "value": str(config.rdzv_port)},
    ]
    task["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "master", "containerPort": config.rdzv_port}
    ]
    _configure_pod(task["template"], spec, config, env)


def _build_pytorchjob(docs: list[dict], spec: TrainingJobSpec, config: K8sLaunchConfig) -> None:
    (job,) = docs
    job["metadata"]["name"] = spec.name
    job["metadata"].setdefault("labels", {})[JOB_LABEL] = spec.name
    job["spec"]["nprocPerNode"] = str(spec.nproc_per_node)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    replicas["Master"]["replicas"] = 1
    if spec.nnodes == 1:
        replicas.pop("Worker", None)
    else:
        replicas["Worker"]["replicas"] = spec.nnodes - 1
    for replica in replicas.values():
        # The operator sets PET_NNODES / PET_NODE_RANK / PET_MASTER_* from the replica counts.
        _configure_pod(replica["template"], spec, config, [])


BUILDERS: dict[str, Callable[[list[dict], TrainingJobSpec, K8sLaunchConfig], None]] = {
    "indexed": _build_indexed,
    "volcano": _build_volcano,
    "pytorchjob": _build_pytorchjob,
}


def build_training_objects(spec: TrainingJobSpec, config: K8sLaunchConfig) -> list[dict[str, Any]]:
    """The manifests of one training job, in creation order (the Job last)."""
    docs = load_template(config.template_dir, config.job_kind)
    BUILDERS[config.job_kind](docs, spec, config)
    for obj in docs:
        if spec.operation:
            obj["metadata"].setdefault("annotations", {})[OPERATION_ANNOTATION] = spec.operation
    return docs
