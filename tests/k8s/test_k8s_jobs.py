"""Training workloads built by the trainer's Kubernetes launcher (services.common.k8s_jobs):
for given parallel layouts they carry the right ranks, environment, resources and rendezvous
settings, validate strictly, and match the kustomize templates they are built from."""

from __future__ import annotations

import re

import pytest
from torch.distributed.run import get_args_parser

from services.common.k8s_jobs import (
    K8sLaunchConfig,
    TrainingJobSpec,
    build_training_objects,
    job_name,
)
from tests.k8s.helpers import (
    KUBERNETES_VERSIONS,
    container_env,
    expand,
    pod_templates,
    render,
    validate_object,
)

OPERATION = "operations/train-0123abcd4567"
FLAGS = ("--model", "tiny-llama", "--mock-data", "--save", "/data/run/ckpt", "--train-iters", "5")


def _spec(**overrides) -> TrainingJobSpec:
    values = dict(
        name=job_name(OPERATION),
        args=FLAGS,
        image="registry.example/meshline:0.1.0",
        operation=OPERATION,
        namespace="research",
    )
    values.update(overrides)
    return TrainingJobSpec(**values)


def _torchrun(container: dict, extra_env: dict[str, str] | None = None):
    env = container_env(container, {"POD_NAMESPACE": "research", **(extra_env or {})})
    args = [expand(a, env) for a in container["args"]]
    assert args[:3] == ["python", "-m", "torch.distributed.run"]
    cut = args.index("services.trainer.train")
    parsed = get_args_parser().parse_args([*args[3 : cut - 1], "train.py"])
    return parsed, args[cut + 1 :], env


def test_job_names_are_dns_labels_from_the_operation():
    assert job_name(OPERATION) == "meshline-train-0123abcd4567"
    assert job_name("operations/Train_X/y") == "meshline-y"
    with pytest.raises(ValueError, match="DNS label"):
        TrainingJobSpec(name="Bad_Name", args=())
    with pytest.raises(ValueError, match="nnodes"):
        _spec(nnodes=0)


@pytest.mark.parametrize(("nnodes", "nproc"), [(1, 1), (2, 1), (4, 8)])
@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_indexed_job_ranks_rendezvous_and_resources(nnodes, nproc, accelerator):
    config = K8sLaunchConfig(job_kind="indexed", accelerator=accelerator, worker_cpu="3")
    spec = _spec(
        nnodes=nnodes, nproc_per_node=nproc, max_restarts=2, env=(("NCCL_IB_HCA", "mlx5"),)
    )
    service, job = build_training_objects(spec, config)
    name = spec.name
    assert service["metadata"]["name"] == job["metadata"]["name"] == name
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes
    assert job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == name
    assert service["spec"]["selector"] == {"meshline.dev/train-job": name}
    assert pod["metadata"]["labels"]["meshline.dev/train-job"] == name
    assert pod["metadata"]["annotations"]["meshline.dev/operation"] == OPERATION
    container = pod["spec"]["containers"][0]
    assert container["image"] == spec.image
    args, flags, env = _torchrun(container)
    assert (args.nnodes, args.nproc_per_node) == (str(nnodes), str(nproc))
    assert args.rdzv_backend == "c10d" and args.max_restarts == 2
    assert args.rdzv_endpoint == f"{name}-0.{name}.research.svc.cluster.local:29400"
    assert args.rdzv_id == name
    assert tuple(flags) == FLAGS
    assert env["NCCL_IB_HCA"] == "mlx5"
    # #37: a per-job random nonce frames the metrics lines (the local launcher's framing).
    assert re.fullmatch(r"[0-9a-f]{32}", env["MESHLINE_METRICS_STDOUT"])
    resources = container["resources"]
    assert resources["requests"]["cpu"] == "3" and resources["limits"]["cpu"] == "6"
    if accelerator == "gpu":
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
        assert resources["limits"]["nvidia.com/gpu"] == str(nproc)
        assert env["NCCL_DEBUG"] == "WARN"
    else:
        assert not any("/" in key for key in resources["limits"])
        assert env["OMP_NUM_THREADS"] == "1"
    for version in KUBERNETES_VERSIONS:
        validate_object(service, version)
        validate_object(job, version)


@pytest.mark.parametrize(("nnodes", "nproc"), [(2, 8), (16, 8)])
def test_volcano_job_for_ascend_gangs_and_passes_node_ranks(nnodes, nproc):
    config = K8sLaunchConfig(job_kind="volcano", accelerator="ascend", volcano_queue="llm")
    (job,) = build_training_objects(_spec(nnodes=nnodes, nproc_per_node=nproc), config)
    assert job["spec"]["minAvailable"] == job["spec"]["tasks"][0]["replicas"] == nnodes
    assert job["spec"]["queue"] == "llm" and job["spec"]["schedulerName"] == "volcano"
    container = job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]
    for rank in (0, nnodes - 1):
        args, _, env = _torchrun(container, {"VC_TASK_INDEX": str(rank)})
        assert args.node_rank == rank
        assert (args.nnodes, args.nproc_per_node) == (str(nnodes), str(nproc))
        name = job["metadata"]["name"]
        assert args.master_addr == f"{name}-worker-0.{name}.research.svc.cluster.local"
        assert args.master_port == 29400
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == str(nproc)
    assert env["HCCL_CONNECT_TIMEOUT"] == "1200" and env["HCCL_EXEC_TIMEOUT"] == "1800"
    hccl_ip = next(e for e in container["env"] if e["name"] == "HCCL_IF_IP")
    assert hccl_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for version in KUBERNETES_VERSIONS:
        validate_object(job, version)


@pytest.mark.parametrize("nnodes", [1, 3])
def test_pytorchjob_replicas_and_devices(nnodes):
    config = K8sLaunchConfig(job_kind="pytorchjob", accelerator="gpu")
    (job,) = build_training_objects(_spec(nnodes=nnodes, nproc_per_node=4), config)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas.get("Worker", {}).get("replicas", 0) == nnodes - 1
    assert job["spec"]["nprocPerNode"] == "4"
    templates = pod_templates(job)
    assert len({id(t) for t in templates}) == len(templates), "each replica has its own template"
    for template in templates:
        container = template["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert container["args"][-len(FLAGS) :] == list(FLAGS)
    for version in KUBERNETES_VERSIONS:
        validate_object(job, version)


def test_flags_are_never_expanded_by_kubernetes():
    config = K8sLaunchConfig()
    spec = _spec(args=("--log-dir", "/data/$(HOME)/x"))
    _, job = build_training_objects(spec, config)
    container = job["spec"]["template"]["spec"]["containers"][0]
    _, flags, _ = _torchrun(container, {"HOME": "/tmp"})
    assert flags == ["--log-dir", "/data/$(HOME)/x"]


def test_config_from_environment_is_validated():
    config = K8sLaunchConfig.from_env(
        {"MESHLINE_K8S_JOB_KIND": "volcano", "MESHLINE_K8S_RDZV_PORT": "23456",
         "MESHLINE_K8S_SCHEDULE_TIMEOUT": "60", "MESHLINE_K8S_WORKER_MEMORY": "64Gi"}
    )  # fmt: skip
    assert (config.job_kind, config.rdzv_port, config.schedule_timeout_s) == ("volcano", 23456, 60)
    assert config.worker_memory == "64Gi"
    with pytest.raises(ValueError, match="MESHLINE_K8S_JOB_KIND"):
        K8sLaunchConfig(job_kind="mpijob")
    with pytest.raises(ValueError, match="MESHLINE_K8S_ACCELERATOR"):
        K8sLaunchConfig(accelerator="tpu")
    with pytest.raises(ValueError, match="MESHLINE_K8S_TEMPLATES"):
        K8sLaunchConfig(template_dir="/nonexistent")
    with pytest.raises(ValueError, match="MESHLINE_K8S_WORKER_CPU"):
        build_training_objects(_spec(), K8sLaunchConfig(worker_cpu="lots"))


def test_launcher_jobs_come_from_the_kustomize_templates():
    """Built with the template's own settings, a job equals what kustomize renders from it."""
    for kind, accelerator, path in [
        ("indexed", "cpu", "training/indexed"),
        ("volcano", "ascend", "training/volcano"),
        ("pytorchjob", "gpu", "training/pytorchjob"),
    ]:
        rendered = render(path)
        workload = rendered[-1]
        template = pod_templates(workload)[0]
        container = template["spec"]["containers"][0]
        env = container_env(container)
        nnodes = {
            "indexed": workload["spec"].get("completions"),
            "volcano": workload["spec"].get("minAvailable"),
            "pytorchjob": 2,
        }[kind]
        nproc = int(workload["spec"].get("nprocPerNode") or env["NPROC_PER_NODE"])
        flags = container["args"][container["args"].index("services.trainer.train") + 1 :]
        spec = TrainingJobSpec(
            name=workload["metadata"]["name"], args=tuple(flags), nnodes=nnodes,
            nproc_per_node=nproc, image=container["image"],
        )  # fmt: skip
        requests = container["resources"]["requests"]
        config = K8sLaunchConfig(
            job_kind=kind, accelerator=accelerator, worker_cpu=requests["cpu"],
            worker_memory=container["resources"]["limits"]["memory"],
            shm_size=next(v["emptyDir"]["sizeLimit"] for v in template["spec"]["volumes"]
                          if v["name"] == "dshm"),
            rdzv_port=29400 if kind == "indexed" else 29500,
        )  # fmt: skip
        built = build_training_objects(spec, config)
        assert [o["kind"] for o in built] == [o["kind"] for o in rendered]
        built_container = pod_templates(built[-1])[0]["spec"]["containers"][0]
        assert built_container["args"][: len(container["args"])] == container["args"]
        assert built_container["resources"]["limits"] == container["resources"]["limits"]
        built_env = container_env(built_container, {"POD_NAMESPACE": "default"})
        for key, value in container_env(container, {"POD_NAMESPACE": "default"}).items():
            if key in ("RDZV_ENDPOINT", "MASTER_ADDR"):
                # The template names pods by short or namespaced DNS; both resolve the same pod.
                assert built_env[key].split(".")[0] == value.split(".")[0]
            elif key == "MESHLINE_METRICS_STDOUT":
                # A job applied by hand prints unframed lines ("1"); the launcher's jobs get a
                # fresh nonce, which only the launcher reading their logs knows.
                assert value == "1" and re.fullmatch(r"[0-9a-f]{32}", built_env[key])
            else:
                assert built_env[key] == value, (kind, key)


def test_built_objects_survive_the_kubernetes_client_models_unchanged():
    """The launcher sends Jobs and Services through the client's typed models: nothing is lost."""
    from kubernetes import client

    api = client.ApiClient()
    for accelerator in ("cpu", "gpu", "ascend"):
        config = K8sLaunchConfig(job_kind="indexed", accelerator=accelerator)
        service, job = build_training_objects(_spec(nnodes=2, nproc_per_node=4), config)
        for obj, model in ((service, client.V1Service), (job, client.V1Job)):
            assert api.sanitize_for_serialization(model.from_dict(obj)) == obj


def test_a_non_numeric_setting_names_its_variable():
    with pytest.raises(ValueError, match="MESHLINE_K8S_RDZV_PORT='abc' is not a number"):
        K8sLaunchConfig.from_env({"MESHLINE_K8S_RDZV_PORT": "abc"})
