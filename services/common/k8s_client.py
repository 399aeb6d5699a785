"""The few Kubernetes API calls the trainer's launcher makes, on the official `kubernetes` client,
and how the API server's refusals become operation errors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from services.common.errors import Conflict, FailedPrecondition, MeshlineError, Unavailable
from services.common.k8s_jobs import JOB_LABEL


def api_error(status: int | None, body: str, action: str) -> MeshlineError:
    """The operation error for an API server refusal of `action` (e.g. "create Job x in ns")."""
    try:
        message = json.loads(body).get("message", body)
    except (ValueError, AttributeError):
        message = body
    detail = f"{action}: HTTP {status}: {message}"
    if status in (401, 403):
        return FailedPrecondition(
            f"{detail}; the trainer's service account lacks the permission (apply the overlay's "
            "Role, and the Volcano/PyTorchJob rule for those kinds)"
        )
    if status == 404:
        return FailedPrecondition(
            f"{detail}; the namespace or the workload's resource kind does not exist (install "
            "Volcano or the training-operator, or set MESHLINE_K8S_JOB_KIND=indexed)"
        )
    if status == 409:
        return Conflict(f"{detail}; a workload of that name exists: delete it or retry")
    if status == 422:
        return FailedPrecondition(f"{detail}; the cluster rejected the workload's manifest")
    return Unavailable(f"{detail}; the API server may be busy: retry")


class KubeClient:
    """The few API calls the launcher makes, on the official `kubernetes` client."""

    def __init__(self, namespace: str) -> None:
        from kubernetes import client, config

        config.load_incluster_config()
        self.namespace = namespace
        self._client = client
        self._api = client.ApiClient()
        self._core = client.CoreV1Api(self._api)
        self._batch = client.BatchV1Api(self._api)
        self._custom = client.CustomObjectsApi(self._api)

    def _plain(self, obj: Any) -> dict[str, Any]:
        return obj if isinstance(obj, dict) else self._api.sanitize_for_serialization(obj)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Creates one object in the namespace; returns it as the server stored it.

        A refusal raises the MeshlineError `api_error` picks.
        """
        try:
            return self._create(obj)
        except self._client.ApiException as exc:
            action = f"create {obj['kind']} {obj['metadata']['name']} in {self.namespace}"
            raise api_error(exc.status, exc.body or str(exc.reason), action) from exc

    def _create(self, obj: dict[str, Any]) -> dict[str, Any]:
        ns, kind = self.namespace, obj["kind"]
        made: Any
        if obj["apiVersion"] == "v1" and kind == "Service":
            service = self._client.V1Service.from_dict(obj)
            assert service is not None
            made = self._core.create_namespaced_service(ns, service)
        elif obj["apiVersion"] == "batch/v1" and kind == "Job":
            job = self._client.V1Job.from_dict(obj)
            assert job is not None
            made = self._batch.create_namespaced_job(ns, job)
        else:
            group, version = obj["apiVersion"].split("/")
            made = self._custom.create_namespaced_custom_object(
                group, version, ns, f"{kind.lower()}s", obj
            )
        return self._plain(made)

    def set_owner(self, service: str, owner: dict[str, Any]) -> None:
        """Makes the Job own the Service, so deleting the Job (or its TTL) removes both."""
        reference = {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
        }
        body = {"metadata": {"ownerReferences": [reference]}}
        self._core.patch_namespaced_service(service, self.namespace, body)

    def delete_service(self, name: str) -> None:
        """Deletes a Service (one left by a workload that could not be created)."""
        try:
            self._core.delete_namespaced_service(name, self.namespace)
        except self._client.ApiException:
            return

    def list_pods(self, name: str) -> list[dict[str, Any]]:
        """The worker pods of job `name`."""
        pods = self._core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={name}")
        return [self._plain(pod) for pod in pods.items]

    def follow_log(self, pod: str, container: str, since_s: int | None = None) -> Iterator[str]:
        """The container's log lines as they are written (from `since_s` ago), until it exits."""
        # Unparsed (`_preload_content=False`), the call returns the streaming HTTP response.
        response: Any = self._core.read_namespaced_pod_log(
            pod,
            self.namespace,
            container=container,
            follow=True,
            since_seconds=since_s,
            _preload_content=False,
        )
        pending = ""
        for chunk in response.stream(4096, decode_content=True):
            pending += chunk.decode("utf-8", errors="replace")
            *lines, pending = pending.split("\n")
            yield from lines
        if pending:
            yield pending

    def stop(self, obj: dict[str, Any]) -> None:
        """Ends the workload's pods gracefully (SIGTERM, then the grace period)."""
        name, ns = obj["metadata"]["name"], self.namespace
        if obj["apiVersion"] == "batch/v1":
            self._batch.patch_namespaced_job(name, ns, {"spec": {"suspend": True}})
        elif obj["kind"] == "PyTorchJob":
            group, version = obj["apiVersion"].split("/")
            body = {"spec": {"runPolicy": {"suspend": True}}}
            self._custom.patch_namespaced_custom_object(
                group, version, ns, "pytorchjobs", name, body
            )
        else:
            group, version = obj["apiVersion"].split("/")
            self._custom.delete_namespaced_custom_object(
                group, version, ns, f"{obj['kind'].lower()}s", name
            )

    def own_pod(self) -> dict[str, Any] | None:
        """This process's pod (from $POD_NAME / the host name), or None if it cannot be read."""
        name = os.environ.get("POD_NAME") or os.uname().nodename
        try:
            return self._plain(self._core.read_namespaced_pod(name, self.namespace))
        except self._client.ApiException:
            return None
