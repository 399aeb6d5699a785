"""Where the host cannot isolate generated code, HumanEval refuses unless the operator allows it.

`MESHLINE_SANDBOX_ISOLATION=off` makes the startup probe report what a host without user/PID/
mount/network namespaces reports, so these run on every host. Also: the service's real
unprivileged user (not root) gets the same containment through a user namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.evaluator.cli import main as evaluate_main
from services.evaluator.models.grpc_client import GrpcLanguageModel
from services.evaluator.runner import EvalConfig, evaluate
from services.evaluator.sandbox.runner import (
    ISOLATION_ENV,
    UNSAFE_FLAG,
    Check,
    SandboxUnavailable,
    isolation,
    run_check,
    run_program,
)
from tests.security.fake_inference import serve_fake
from tests.security.sandbox_corpus import DOC, FORGERIES
from tests.services.evaluator.lm_eval_ref import FIXTURES

ROOT = Path(__file__).parents[2]


@pytest.fixture
def no_namespaces(monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "off")
    assert not isolation().available


def test_the_library_refuses_and_says_why(no_namespaces):
    for run in (
        lambda: run_check(Check(DOC["prompt"], "    return a + b\n", DOC["test"], "add")),
        lambda: run_program("print(1)\n"),
    ):
        with pytest.raises(SandboxUnavailable) as caught:
            run()
        assert UNSAFE_FLAG in str(caught.value) and ISOLATION_ENV in str(caught.value)


def test_evaluate_refuses_before_generating(no_namespaces, tmp_path):
    inference, fake = serve_fake(lambda prompt: FORGERIES["os_exit_0_before_tests"])
    model = GrpcLanguageModel(inference.address)
    try:
        with pytest.raises(SandboxUnavailable):
            evaluate(EvalConfig(("humaneval",), FIXTURES, tmp_path), model)
    finally:
        model.close()
        inference.stop()
    assert fake.generated == 0


def test_cli_refuses_then_runs_with_the_flag(no_namespaces, tmp_path, capsys):
    inference, fake = serve_fake(lambda prompt: FORGERIES["prints_passed"])
    argv = ["--tasks", "humaneval", "--task-data-path", str(FIXTURES), "--endpoint",
            inference.address, "--output-path", str(tmp_path), "--no-progress"]  # fmt: skip
    try:
        assert evaluate_main(argv) == 2
        assert UNSAFE_FLAG in capsys.readouterr().err
        assert fake.generated == 0
        assert evaluate_main([*argv, UNSAFE_FLAG]) == 0
    finally:
        inference.stop()
    (results,) = tmp_path.rglob("results.json")
    scores = json.loads(results.read_text())["results"]["humaneval"]
    assert scores["pass@1,create_test"] == 0.0
    assert fake.generated == 2


def test_unsafe_mode_keeps_the_verdict_outside_the_completion(no_namespaces):
    for name in ("os_exit_0_before_tests", "nonce_from_frames", "always_equal_object"):
        check = Check(DOC["prompt"], FORGERIES[name], DOC["test"], "add")
        result = run_check(check, allow_unsafe=True)
        assert (result.passed, result.network) == (False, "none"), name
    right = run_check(
        Check(DOC["prompt"], "    return a + b\n", DOC["test"], "add"), allow_unsafe=True
    )
    assert right.passed


def _system_python_for(uid: int) -> str | None:
    """A Python another uid can run (the venv's may live under a private home)."""
    for candidate in ("/usr/bin/python3", sys.executable):
        path = Path(os.path.realpath(candidate))
        if path.exists() and all(p.stat().st_mode & 0o005 == 0o005 for p in path.parents):
            return str(path)
    return None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root+setpriv")
def test_unprivileged_service_user_is_contained_too(tmp_path):
    """The images run services as an unprivileged user: a user namespace gives the isolation."""
    python = _system_python_for(65534)
    if python is None or any(not p.stat().st_mode & 0o005 for p in ROOT.parents):
        pytest.skip("no interpreter or checkout readable by the nobody user")
    os.chmod(tmp_path, 0o777)
    marker = tmp_path / "marker"
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import services.evaluator.sandbox.runner as r
if not r.isolation().available:
    print("NO-USERNS", r.isolation().reason); raise SystemExit(0)
p, t = {DOC["prompt"]!r}, {DOC["test"]!r}
right = r.run_check(r.Check(p, "    return a + b\\n", t, "add"))
forged = r.run_check(r.Check(p, {FORGERIES["nonce_from_frames"]!r}, t, "add"))
escape = r.run_program("import os\\nos.system('touch {marker}')\\nopen('{marker}', 'w')\\n")
print(right.passed, forged.passed, escape.passed, right.network)
"""
    run = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c", script],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    if run.stdout.startswith("NO-USERNS"):
        pytest.skip(f"unprivileged user namespaces unavailable: {run.stdout}")
    assert run.stdout.split() == ["True", "False", "False", "namespace"], run.stderr[-2000:]
    assert not marker.exists()
