"""`meshline serve all` hands its TLS, token and `--metrics-secure` flags to every child (#37):
before, the five services it started listened in plain text with no token whatever the operator
wanted, and their /metrics ports could not be secured at all."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import SERVICES
from services.serve import _all_parser, child_commands, serve_all
from tests.chaos.procs import ROOT
from tests.services.common.helpers import Certs, make_pki

TOKEN = "s3rve-all"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def _security_flags(certs: Certs, token_file: Path) -> list[str]:
    return [
        *("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)),
        *("--auth-token-file", str(token_file), "--metrics-secure"),
    ]


def test_every_child_gets_the_tls_token_and_metrics_flags(certs: Certs, token_file: Path) -> None:
    flags = ["--metrics-base-port", "9100", *_security_flags(certs, token_file)]
    commands = child_commands(_all_parser().parse_args(flags))
    assert sorted(commands) == sorted(SERVICES)
    for command in commands.values():
        assert command[command.index("--tls-cert") + 1] == str(certs.server_cert)
        assert command[command.index("--tls-key") + 1] == str(certs.server_key)
        assert command[command.index("--auth-token-file") + 1] == str(token_file)
        assert "--metrics-secure" in command and "--tls-client-ca" not in command
    plain = child_commands(_all_parser().parse_args([]))
    assert not any("--tls-cert" in c or "--metrics-secure" in c for c in plain.values())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-secure", "--tls-cert", "C", "--tls-key", "K"], "--metrics-base-port"),
        (["--tls-cert", "{cert}"], "--tls-key go together"),
        (["--metrics-base-port", "9100", "--metrics-secure"], "give at least one of them"),
        (["--auth-token-file", "/nonexistent/token"], "--auth-token-file"),
    ],
)
def test_bad_security_flags_are_refused_before_any_child_starts(
    certs: Certs, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [f.format(cert=certs.server_cert) for f in flags]
    started = time.monotonic()
    assert serve_all(flags) == 2
    error = capsys.readouterr().err
    assert message in error and "started" not in error
    assert time.monotonic() - started < 5


def _free_block(count: int) -> int:
    """A base port with `count` consecutive ports free right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise AssertionError("no block of free ports")


@pytest.mark.slow
def test_serve_all_children_serve_tls_and_secure_metrics(
    certs: Certs, token_file: Path, tmp_path: Path
) -> None:
    base, metrics = _free_block(len(SERVICES)), _free_block(len(SERVICES))
    command = [sys.executable, "-m", "services.cli", "serve", "all", "--base-port", str(base)]
    command += ["--metrics-base-port", str(metrics), "--data-root", str(tmp_path)]
    command += _security_flags(certs, token_file)
    parent = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        deadline = time.monotonic() + 180
        for offset in range(len(SERVICES)):
            url = f"https://127.0.0.1:{metrics + offset}/metrics"
            while True:
                assert parent.poll() is None, "serve all exited"
                try:
                    scrape = requests.get(url, verify=str(certs.ca), headers=auth, timeout=5)
                    break
                except requests.exceptions.ConnectionError:
                    assert time.monotonic() < deadline, f"{url} never answered"
                    time.sleep(0.5)
            assert scrape.status_code == 200
            refused = requests.get(url, verify=str(certs.ca), timeout=5)
            assert refused.status_code == 401 and b"meshline_" not in refused.content
            with pytest.raises(requests.exceptions.ConnectionError):
                requests.get(f"http://127.0.0.1:{metrics + offset}/metrics", timeout=5)
        # gRPC: TLS and the token on every child.
        credentials = grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(certs.ca.read_bytes()),
            grpc.access_token_call_credentials(TOKEN),
        )
        for offset in range(len(SERVICES)):
            with grpc.secure_channel(f"127.0.0.1:{base + offset}", credentials) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            plain = grpc.insecure_channel(f"127.0.0.1:{base + offset}")
            with plain, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        parent.send_signal(signal.SIGTERM)
        try:
            parent.wait(90)
        except subprocess.TimeoutExpired:
            parent.kill()
            parent.wait()
