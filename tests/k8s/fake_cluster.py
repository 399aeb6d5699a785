"""A scripted stand-in for the Kubernetes API server behind the launcher's client interface."""

from __future__ import annotations

import json
import re


def pod(name, phase="Running", *, terminated=None, waiting=None, running=False, **status):
    """A pod as the API returns it, with one container in the given state."""
    state = {}
    if terminated is not None:
        state["terminated"] = terminated
    if waiting is not None:
        state["waiting"] = waiting
    if running:
        state["running"] = {"startedAt": "2026-01-01T00:00:00Z"}
    status_entry = {"name": "trainer", "state": state}
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "trainer"}]},
        "status": {"phase": phase, "containerStatuses": [status_entry], **status},
    }


def running(name):
    """A pod whose worker runs."""
    return pod(name, running=True)


def done(name, code=0, reason="Completed"):
    """A pod whose worker exited with `code`."""
    return pod(
        name,
        "Succeeded" if code == 0 else "Failed",
        terminated={"exitCode": code, "reason": reason},
    )


class FakeCluster:
    """Plays the API server: records calls and returns scripted pod lists, one per poll."""

    namespace = "research"

    def __init__(self, polls, logs=None, after_stop=None):
        self.polls = list(polls)
        self.logs = logs or {}
        self.after_stop = after_stop
        self.created: list[dict] = []
        self.owners: list[tuple[str, str]] = []
        self.stopped: list[str] = []
        self.log_opens: list[tuple[str, int | None]] = []
        self.list_failures = 0
        self.refuse: dict[str, Exception] = {}
        self.deleted_services: list[str] = []

    def delete_service(self, name):
        self.deleted_services.append(name)

    def create(self, obj):
        if obj["kind"] in self.refuse:
            raise self.refuse[obj["kind"]]
        made = json.loads(json.dumps(obj))
        made["metadata"]["uid"] = f"uid-{len(self.created)}"
        self.created.append(made)
        return made

    def set_owner(self, service, owner):
        self.owners.append((service, owner["metadata"]["uid"]))

    def list_pods(self, name):
        assert name == self.created[-1]["metadata"]["name"]
        if self.list_failures:
            self.list_failures -= 1
            raise ConnectionError("API server unreachable")
        if self.stopped and self.after_stop is not None:
            return self.after_stop
        return self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]

    def metrics_nonce(self):
        """The nonce the last workload gave its pods in $MESHLINE_METRICS_STDOUT."""
        found = re.search(
            r'"name": "MESHLINE_METRICS_STDOUT", "value": "([0-9a-f]+)"',
            json.dumps(self.created[-1]),
        )
        assert found, "the workload gives its pods no metrics nonce"
        return found[1]

    def follow_log(self, pod, container, since_s=None):
        """The scripted lines; `METRICS:{json}` is printed as rank 0 would, framed with the nonce
        the pod was given (other lines, forged metrics lines included, go out verbatim)."""
        self.log_opens.append((pod, since_s))
        lines = self.logs.get(pod, [])
        # A list of lists plays a stream the API server drops: one part per opening.
        if lines and isinstance(lines[0], list):
            lines = lines.pop(0) if len(lines) > 1 else lines[0]
        for line in lines:
            if line.startswith("METRICS:"):
                line = f"MESHLINE_METRICS {self.metrics_nonce()} {line[len('METRICS:') :]}"
            yield line

    def stop(self, obj):
        self.stopped.append(obj["metadata"]["name"])
