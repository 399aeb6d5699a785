"""`--metrics-secure`: the /metrics port gets the service's TLS files and bearer token (#37).

The metrics port had no TLS or auth option: anyone reaching it read every series. With
`--metrics-secure` a scrape without the token gets 401 and not one metric byte; plain HTTP to
the TLS port gets nothing; with mTLS a client without a certificate from the CA is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from services.common.config import ServerConfig
from services.common.metrics import start_metrics_server
from services.common.server import metrics_security
from tests.services.common.helpers import Certs


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("m3trics\n")
    return path


def _serve(config: ServerConfig):
    server = start_metrics_server("127.0.0.1", 0, **metrics_security(config))
    return server, f"127.0.0.1:{server.server_port}/metrics"


def test_token_and_tls_guard_the_metrics_port(certs: Certs, token_file: Path) -> None:
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        auth_token_file=str(token_file),
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        metrics_port=0,
        metrics_secure=True,
    )
    server, where = _serve(config)
    try:
        url = f"https://{where}"
        refused = requests.get(url, verify=str(certs.ca), timeout=10)
        assert refused.status_code == 401 and b"meshline_" not in refused.content
        wrong = requests.get(
            url, verify=str(certs.ca), timeout=10, headers={"Authorization": "Bearer x"}
        )
        assert wrong.status_code == 401
        good = requests.get(
            url, verify=str(certs.ca), timeout=10, headers={"Authorization": "Bearer m3trics"}
        )
        assert good.status_code == 200 and b"meshline_grpc_requests_total" in good.content
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://{where}", timeout=10)  # no plaintext on the TLS port
    finally:
        server.shutdown()
        server.server_close()


def test_mtls_on_the_metrics_port_needs_a_client_certificate(certs: Certs) -> None:
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        tls_client_ca=str(certs.ca),
        metrics_port=0,
        metrics_secure=True,
    )
    server, where = _serve(config)
    try:
        url = f"https://{where}"
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(url, verify=str(certs.ca), timeout=10)
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(
                url,
                verify=str(certs.ca),
                timeout=10,
                cert=(str(certs.rogue_cert), str(certs.rogue_key)),
            )
        good = requests.get(
            url,
            verify=str(certs.ca),
            timeout=10,
            cert=(str(certs.client_cert), str(certs.client_key)),
        )
        assert good.status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_secure_without_anything_to_reuse_is_refused(token_file: Path) -> None:
    with pytest.raises(ValueError, match="--metrics-secure needs --metrics-port"):
        ServerConfig(auth_token_file=str(token_file), metrics_secure=True)
    with pytest.raises(ValueError, match="give at least one of them"):
        ServerConfig(metrics_port=0, metrics_secure=True)
    plain = ServerConfig(metrics_port=0)
    assert metrics_security(plain) == {}  # default: plain HTTP, no auth, as documented
