"""The image's entry point and the pipeline's stage script, run with a real POSIX shell."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.k8s.helpers import K8S, ROOT

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
STAGE = K8S / "pipeline" / "scripts" / "stage.sh"


@pytest.fixture
def fake_path(tmp_path: Path) -> dict[str, str]:
    """PATH with a `meshline` that prints its argv, so dispatch is observable without torch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "meshline"
    fake.write_text('#!/bin/sh\necho "meshline $*"\n')
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def _entry(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    "service", ["preprocess", "trainer", "converter", "inference", "evaluator"]
)
def test_entrypoint_serves_the_named_service(fake_path, service):
    result = _entry(fake_path, service, "--port=50051", "--host=0.0.0.0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"meshline serve {service} --port=50051 --host=0.0.0.0"


def test_entrypoint_runs_commands_and_reads_the_service_from_the_environment(fake_path):
    assert _entry(fake_path, "meshline", "train", "--mock-data").stdout.strip() == (
        "meshline train --mock-data"
    )
    assert _entry(fake_path, "echo", "hi").stdout.strip() == "hi"
    assert _entry(fake_path, "all", "--host", "0.0.0.0").stdout.strip() == (
        "meshline serve all --host 0.0.0.0"
    )
    env = {**fake_path, "MESHLINE_SERVICE": "inference"}
    assert _entry(env).stdout.strip() == "meshline serve inference"


def test_entrypoint_explains_missing_or_misplaced_service(fake_path):
    result = _entry(fake_path)
    assert result.returncode == 2 and "MESHLINE_SERVICE" in result.stderr
    result = _entry(fake_path, "--port=1")
    assert result.returncode == 2 and "service name first" in result.stderr


def _stage(
    run_dir: Path, *args: str, index: str | None = None, every_pod: bool = False
) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PIPELINE_DIR": str(run_dir), "STAGE_POLL_SECONDS": "1"}
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = index
    if every_pod:
        env["STAGE_EVERY_POD"] = "1"
    return subprocess.run(
        ["sh", str(STAGE), *args], env=env, capture_output=True, text=True, timeout=30
    )


def test_stage_runs_once_marks_done_and_skips_on_the_next_apply(tmp_path):
    counter = tmp_path / "count"
    command = ["sh", "-c", f"echo x >> {counter}"]
    assert _stage(tmp_path, "run", "preprocess", *command).returncode == 0
    assert (tmp_path / "stages" / "preprocess.done").is_file()
    again = _stage(tmp_path, "run", "preprocess", *command)
    assert again.returncode == 0 and "skipping" in again.stdout
    assert counter.read_text() == "x\n"
    assert not list((tmp_path / "stages").glob("*.tmp"))


def test_only_pod_zero_marks_a_multi_pod_stage_done(tmp_path):
    assert _stage(tmp_path, "run", "train", "true", index="1").returncode == 0
    assert not (tmp_path / "stages" / "train.done").exists()
    assert _stage(tmp_path, "run", "train", "true", index="0").returncode == 0
    assert (tmp_path / "stages" / "train.done").exists()


def test_per_pod_stages_are_marked_by_every_pod_and_awaited_together(tmp_path):
    for index in ("2", "1"):
        stage = f"preprocess-part-{index}"
        assert _stage(tmp_path, "run", stage, "true", index=index, every_pod=True).returncode == 0
        assert (tmp_path / "stages" / f"{stage}.done").exists()
    parts = [f"preprocess-part-{i}" for i in range(3)]
    result: list[subprocess.CompletedProcess] = []
    waiter = threading.Thread(target=lambda: result.append(_stage(tmp_path, "wait", *parts)))
    waiter.start()
    time.sleep(1.5)
    assert waiter.is_alive(), "part 0 is not done yet"
    _stage(tmp_path, "run", "preprocess-part-0", "true", index="0", every_pod=True)
    waiter.join(timeout=30)
    assert result[0].returncode == 0
    assert result[0].stdout.count("is done") == 3
    failed = _stage(tmp_path, "run", "x-1", "false", index="1", every_pod=True)
    assert failed.returncode == 1
    waiting = _stage(tmp_path, "wait", "preprocess-part-0", "x-1")
    assert waiting.returncode == 1 and "stage x-1 failed" in waiting.stderr


def test_failed_stage_is_marked_and_stops_the_waiting_stage(tmp_path):
    failed = _stage(tmp_path, "run", "train", "sh", "-c", "exit 7")
    assert failed.returncode == 7
    assert re.match(r"exit code 7 on ", (tmp_path / "stages" / "train.failed").read_text())
    waiter = _stage(tmp_path, "wait", "train")
    assert waiter.returncode == 1 and "stage train failed" in waiter.stderr


def test_wait_returns_once_the_stage_is_done(tmp_path):
    def finish_later() -> None:
        time.sleep(0.5)
        _stage(tmp_path, "run", "convert", "true")

    thread = threading.Thread(target=finish_later)
    thread.start()
    started = time.monotonic()
    result = _stage(tmp_path, "wait", "convert")
    thread.join()
    assert result.returncode == 0 and "stage convert is done" in result.stdout
    assert time.monotonic() - started >= 0.4


def test_stage_needs_its_run_directory(tmp_path):
    result = subprocess.run(
        ["sh", str(STAGE), "wait", "x"],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0 and "PIPELINE_DIR" in result.stderr


RUNTIME_PACKAGES = (
    "kernels",
    "models",
    "tokendata",
    "checkpoints",
    "parallel",
    "engine",
    "training",
    "services",
)
"""The packages a service imports at run time (the libraries and services/)."""


def test_runtime_packages_are_the_packaged_ones():
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert include
    packaged = {name.strip('" *') for name in include.group(1).split(",")}
    assert packaged - {"meshline"} == set(RUNTIME_PACKAGES)


def test_dockerfiles_are_pinned_non_root_and_use_the_entrypoint():
    for flavour in ("cpu", "cuda", "ascend"):
        text = (ROOT / "docker" / f"Dockerfile.{flavour}").read_text()
        bases = re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M)
        assert bases, flavour
        for base in bases:
            _, _, tag = base.partition(":")
            assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), (flavour, base)
        user = re.findall(r"^USER (\S+)$", text, re.M)[-1]
        assert user.split(":")[0] not in ("0", "root") and user.split(":")[0].isdigit()
        assert 'ENTRYPOINT ["/usr/local/bin/meshline-entrypoint"]' in text
        assert re.search(r"torch==\$\{TORCH_VERSION\}", text)
        for source in re.findall(r"^COPY (?:--chmod=\S+ )?(\S+) ", text, re.M):
            if not source.startswith("--from"):
                assert (ROOT / source).exists(), f"Dockerfile.{flavour} copies missing {source}"
        ignore = (ROOT / "docker" / f"Dockerfile.{flavour}.dockerignore").read_text()
        assert "!k8s/training/**" in ignore and "!docker/entrypoint.sh" in ignore
        for package in RUNTIME_PACKAGES:  # every library and the services go into the image
            assert re.search(rf"^COPY {package} {package}$", text, re.M), (flavour, package)
            assert f"!{package}/**" in ignore, (flavour, package)
