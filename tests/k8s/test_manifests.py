"""Every kustomization renders, validates against Kubernetes' schemas (built-in kinds, strict)
or the bundled CRD schemas (Volcano Job, PyTorchJob), and holds the settings the issue asks for:
gRPC probes, hardened pods, config and token wiring, least-privilege RBAC, accelerator resources,
the pipeline's order."""

from __future__ import annotations

import pytest

from tests.k8s.helpers import (
    KUBERNETES_VERSIONS,
    container_env,
    find,
    kustomizations,
    render,
    validate_object,
)

SERVICES = {
    "preprocess": 50051,
    "trainer": 50052,
    "converter": 50053,
    "inference": 50054,
    "evaluator": 50055,
}
OVERLAYS = ("overlays/cpu", "overlays/gpu", "overlays/ascend", "overlays/gpu-pytorchjob")


def test_every_expected_kustomization_exists():
    found = set(kustomizations())
    expected = {
        "base",
        "storage",
        "pipeline",
        "rollout",
        "training/indexed",
        "training/volcano",
        "training/pytorchjob",
        *OVERLAYS,
        *(f"{o}/training" for o in OVERLAYS),
    }
    assert expected <= found, f"missing: {sorted(expected - found)}"


@pytest.mark.parametrize("path", kustomizations())
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_renders_and_validates_strictly(path, version):
    objects = render(path)
    assert objects, f"k8s/{path} rendered nothing"
    for obj in objects:
        validate_object(obj, version)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_have_probes_hardening_config_and_token(overlay):
    objects = render(overlay)
    config_maps = {o["metadata"]["name"] for o in find(objects, "ConfigMap")}
    for name, port in SERVICES.items():
        (deployment,) = find(objects, "Deployment", f"meshline-{name}")
        (service,) = find(objects, "Service", f"meshline-{name}")
        pod = deployment["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert service["spec"]["ports"][0]["port"] == port
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        (container,) = spec["containers"]
        assert container["args"][0] == name, "the image's entry point picks the service"
        assert f"--port={port}" in container["args"] and "--host=0.0.0.0" in container["args"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (name, probe)
        hardening = container["securityContext"]
        assert hardening["allowPrivilegeEscalation"] is False
        assert hardening["readOnlyRootFilesystem"] is True
        assert hardening["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
        assert {"cpu", "memory"} <= container["resources"]["limits"].keys()
        (config_ref,) = container["envFrom"]
        assert config_ref["configMapRef"]["name"] in config_maps
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        token_dir = mounts["auth"]
        assert f"--auth-token-file={token_dir}/token" in container["args"]
        assert volumes["auth"]["secret"]["secretName"] == "meshline-auth"
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "meshline-data"
        assert mounts["tmp"] == "/tmp", "a writable /tmp beside the read-only root"
        config = next(
            o
            for o in find(objects, "ConfigMap")
            if o["metadata"]["name"] == config_ref["configMapRef"]["name"]
        )
        assert spec["terminationGracePeriodSeconds"] > int(config["data"]["MESHLINE_GRACE_PERIOD"])
        for arg in container["args"]:
            for var in arg.split("$(")[1:]:
                key = var.split(")")[0]
                assert key in config["data"] or key == "POD_NAME", f"{name}: $({key}) is not set"
        automount = spec["automountServiceAccountToken"]
        assert automount is (name == "trainer"), "only the trainer talks to the API server"
        assert spec["serviceAccountName"] == (
            "meshline-trainer" if name == "trainer" else "meshline"
        )
    (claim,) = find(objects, "PersistentVolumeClaim", "meshline-data")
    assert claim["spec"]["accessModes"] == (
        ["ReadWriteOnce"] if overlay == "overlays/cpu" else ["ReadWriteMany"]
    )
    (namespace,) = find(objects, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_expose_metrics_and_inference_the_http_api(overlay):
    objects = render(overlay)
    for name in SERVICES:
        (deployment,) = find(objects, "Deployment", f"meshline-{name}")
        (service,) = find(objects, "Service", f"meshline-{name}")
        pod = deployment["spec"]["template"]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert annotations["prometheus.io/port"] == str(ports["metrics"])
        assert f"--metrics-port={ports['metrics']}" in container["args"]
        service_ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
        assert service_ports["metrics"] == "metrics"
        if name == "inference":
            assert f"--http-port={ports['http']}" in container["args"]
            assert service_ports["http"] == "http"


@pytest.mark.parametrize(
    ("overlay", "extra_group"),
    [
        ("overlays/cpu", None),
        ("overlays/gpu", None),
        ("overlays/ascend", "batch.volcano.sh"),
        ("overlays/gpu-pytorchjob", "kubeflow.org"),
    ],
)
def test_trainer_rbac_is_least_privilege(overlay, extra_group):
    objects = render(overlay)
    (role,) = find(objects, "Role", "meshline-trainer")
    (binding,) = find(objects, "RoleBinding", "meshline-trainer")
    assert binding["roleRef"]["name"] == "meshline-trainer"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "meshline-trainer", "namespace": "meshline"}
    ]
    assert not find(objects, "ClusterRole") and not find(objects, "ClusterRoleBinding")
    allowed = {
        ("batch", "jobs"): {"create", "get", "list", "watch", "patch", "delete"},
        ("", "services"): {"create", "get", "patch", "delete"},
        ("", "pods"): {"get", "list", "watch"},
        ("", "pods/log"): {"get"},
    }
    if extra_group == "batch.volcano.sh":
        allowed[(extra_group, "jobs")] = allowed[("batch", "jobs")]
    if extra_group == "kubeflow.org":
        allowed[(extra_group, "pytorchjobs")] = allowed[("batch", "jobs")]
    granted = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted[(group, resource)] = set(rule["verbs"])
    assert granted == allowed
    config = find(objects, "ConfigMap")[0]["data"]
    kind = {"overlays/ascend": "volcano", "overlays/gpu-pytorchjob": "pytorchjob"}
    assert config["MESHLINE_K8S_JOB_KIND"] == kind.get(overlay, "indexed")


@pytest.mark.parametrize(
    ("overlay", "resource", "tag"),
    [
        ("overlays/cpu", None, "0.1.0-cpu"),
        ("overlays/gpu", "nvidia.com/gpu", "0.1.0-cuda"),
        ("overlays/ascend", "huawei.com/Ascend910", "0.1.0-ascend"),
    ],
)
def test_overlays_set_image_and_accelerator(overlay, resource, tag):
    objects = render(overlay)
    for deployment in find(objects, "Deployment"):
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == f"meshline:{tag}"
    (inference,) = find(objects, "Deployment", "meshline-inference")
    limits = inference["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    if resource:
        assert limits[resource] == "1"
    else:
        assert not any("/" in key for key in limits)
    config = find(objects, "ConfigMap")[0]["data"]
    assert config["MESHLINE_K8S_ACCELERATOR"] == {"overlays/cpu": "cpu", "overlays/gpu": "gpu"}.get(
        overlay, "ascend"
    )


def _torchrun_args(container: dict, extra_env: dict[str, str]) -> list[str]:
    from tests.k8s.helpers import expand

    env = container_env(container, extra_env)
    args = [expand(a, env) for a in container["args"]]
    start = args.index("torch.distributed.run") + 1
    return args[start : args.index("services.trainer.train") - 1]


def test_indexed_training_job_meets_at_pod_zero_through_the_headless_service():
    from torch.distributed.run import get_args_parser

    objects = render("overlays/gpu/training")
    (service,) = find(objects, "Service", "meshline-train")
    (job,) = find(objects, "Job", "meshline-train")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    pod = job["spec"]["template"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    args = get_args_parser().parse_args(
        [*_torchrun_args(container, {"POD_NAMESPACE": "meshline"}), "train.py"]
    )
    assert args.nnodes == str(job["spec"]["completions"]) == str(job["spec"]["parallelism"])
    assert args.nproc_per_node == "8"
    assert args.rdzv_backend == "c10d"
    assert args.rdzv_endpoint == "meshline-train-0.meshline-train.meshline.svc.cluster.local:29400"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_volcano_training_job_is_gang_scheduled_with_explicit_ranks_and_hccl():
    from torch.distributed.run import get_args_parser

    (job,) = render("overlays/ascend/training")
    assert job["spec"]["schedulerName"] == "volcano"
    (task,) = job["spec"]["tasks"]
    assert job["spec"]["minAvailable"] == task["replicas"], "gang: all workers or none"
    assert "svc" in job["spec"]["plugins"] and "env" in job["spec"]["plugins"]
    container = task["template"]["spec"]["containers"][0]
    env = container_env(container, {"VC_TASK_INDEX": "1"})
    args = get_args_parser().parse_args([*_torchrun_args(container, {"VC_TASK_INDEX": "1"}), "x"])
    assert args.nnodes == str(task["replicas"]) and args.node_rank == 1
    assert (
        args.master_addr == f"{job['metadata']['name']}-{task['name']}-0.{job['metadata']['name']}"
    )
    assert args.nproc_per_node == container["resources"]["limits"]["huawei.com/Ascend910"] == "8"
    assert int(env["HCCL_CONNECT_TIMEOUT"]) >= 600 and int(env["HCCL_EXEC_TIMEOUT"]) >= 600
    names = {e["name"] for e in container["env"]}
    assert {"HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_WHITELIST_DISABLE"} <= names


def test_pytorchjob_training_passes_operator_ranks_to_torchrun():
    from torch.distributed.run import get_args_parser

    (job,) = render("overlays/gpu-pytorchjob/training")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    operator_env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "meshline-train-master-0",
        "PET_MASTER_PORT": "23456",
    }
    for replica in replicas.values():
        container = replica["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"
        args = get_args_parser().parse_args([*_torchrun_args(container, operator_env), "x"])
        assert (args.nnodes, args.node_rank, args.master_port) == ("2", 1, 23456)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == job["spec"]["nprocPerNode"]


def test_pipeline_runs_ordered_stages_on_one_volume():
    objects = render("pipeline")
    jobs = {j["metadata"]["name"]: j for j in find(objects, "Job")}
    stage_of = {
        "meshline-pipeline-preprocess": "preprocess-part-$(JOB_COMPLETION_INDEX)",
        "meshline-pipeline-preprocess-merge": "preprocess",
        "meshline-train": "train",
        "meshline-pipeline-convert": "convert",
        "meshline-pipeline-evaluate": "evaluate",
    }
    assert set(jobs) == set(stage_of)
    waits = {}
    for name, job in jobs.items():
        spec = job["spec"]["template"]["spec"]
        stage = stage_of[name]
        (main,) = spec["containers"]
        assert main["args"][:4] == ["sh", "/opt/meshline/pipeline/stage.sh", "run", stage]
        inits = spec.get("initContainers", [])
        waits[stage] = [s for c in inits if c["args"][2] == "wait" for s in c["args"][3:]]
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claims == {"meshline-data"}
        assert job["spec"]["backoffLimit"] == 0, "a failed stage must stop the ones after it"
    assert waits == {
        "preprocess-part-$(JOB_COMPLETION_INDEX)": [],
        "preprocess": ["preprocess-part-0", "preprocess-part-1", "preprocess-part-2"],
        "train": ["preprocess"],
        "convert": ["train"],
        "evaluate": ["convert"],
    }
    scripts = next(c for c in find(objects, "ConfigMap") if "stage.sh" in c.get("data", {}))
    assert {"stage.sh", "preprocess.sh", "preprocess_merge.sh", "demo_data.py", "train.yaml"} <= (
        scripts["data"].keys()
    )
    train = jobs["meshline-train"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--config=/opt/meshline/pipeline/train.yaml" in train
    assert "--data-path=$(PIPELINE_DIR)/shards/corpus_text_document" in train, "the merged shard"
    convert = jobs["meshline-pipeline-convert"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--load-dir=$(PIPELINE_DIR)/checkpoints" in convert
    assert "--save=$(PIPELINE_DIR)/checkpoints" in train


def test_pipeline_preprocess_is_an_indexed_job_of_shards_then_a_merge():
    objects = render("pipeline")
    jobs = {j["metadata"]["name"]: j for j in find(objects, "Job")}
    config = next(c for c in find(objects, "ConfigMap") if "PIPELINE_DIR" in c.get("data", {}))
    shards = int(config["data"]["MESHLINE_PREPROCESS_SHARDS"])
    assert shards > 1
    job = jobs["meshline-pipeline-preprocess"]["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == shards, "one pod per shard, all at once"
    (pod,) = job["template"]["spec"]["containers"]
    # Every pod marks its own stage, named by the index the Job controller sets in its env.
    assert container_env(pod)["STAGE_EVERY_POD"] == "1"
    assert pod["args"][3] == "preprocess-part-$(JOB_COMPLETION_INDEX)"
    assert pod["args"][4:] == ["sh", "/opt/meshline/pipeline/preprocess.sh"]
    merge = jobs["meshline-pipeline-preprocess-merge"]["spec"]
    assert merge.get("completions", 1) == 1 and "completionMode" not in merge
    (wait,) = merge["template"]["spec"]["initContainers"]
    assert wait["args"][3:] == [f"preprocess-part-{i}" for i in range(shards)]
    (main,) = merge["template"]["spec"]["containers"]
    assert main["args"][-1] == "/opt/meshline/pipeline/preprocess_merge.sh"
    scripts = next(c for c in find(objects, "ConfigMap") if "stage.sh" in c.get("data", {}))
    preprocess = scripts["data"]["preprocess.sh"]
    assert '--num-shards "${MESHLINE_PREPROCESS_SHARDS:-1}"' in preprocess
    assert "--shard-index" not in preprocess, "the index comes from JOB_COMPLETION_INDEX"
    merge_script = scripts["data"]["preprocess_merge.sh"]
    assert "meshline preprocess merge" in merge_script
    assert '--output-prefix "$PIPELINE_DIR/shards/corpus"' in merge_script
    assert '--output-prefix "$PIPELINE_DIR/shards/corpus"' in preprocess


def test_pipeline_train_config_is_valid_for_the_trainer():
    from services.trainer.arguments import parse_args
    from tests.k8s.helpers import K8S

    config = parse_args(
        ["--config", str(K8S / "pipeline/scripts/train.yaml"), "--data-path", "/d/x_text_document",
         "--tokenizer-model", "/d/t.model"]
    ).validate(2)  # fmt: skip
    assert config.run.train_iters == 300 and config.batch.global_batch_size == 16


def test_rollout_servers_take_weight_updates_and_scale_with_an_hpa():
    objects = render("rollout")
    (deployment,) = find(objects, "Deployment", "meshline-rollout")
    (service,) = find(objects, "Service", "meshline-rollout")
    (hpa,) = find(objects, "HorizontalPodAutoscaler", "meshline-rollout")
    (config,) = find(objects, "ConfigMap")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "meshline-rollout")
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert "cpu" in container["resources"]["requests"], "utilisation needs a CPU request"
    args = container["args"]
    assert args[0] == "inference" and "--allow-weight-updates" in args
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert f"--auth-token-file={mounts['auth']}/token" in args
    assert pod["spec"]["volumes"][2]["secret"]["secretName"] == "meshline-auth"
    for arg in args:
        for var in arg.split("$(")[1:]:
            assert var.split(")")[0] in config["data"], arg
    assert container["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
    # Headless: every ready replica has its own DNS record, so a push reaches each one.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 50054
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
