"""Server settings shared by every Meshline service, and the one place they map onto CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
# gRPC keeps message sizes in a signed 32-bit int of bytes.
MAX_MESSAGE_MB_LIMIT = 2047


@dataclass
class ServerConfig:
    """How one gRPC server listens, secures itself, limits load and stops."""

    host: str = "127.0.0.1"
    """Interface to bind (`0.0.0.0` or `::` for all; keep localhost unless TLS or a mesh is in front)."""
    port: int = 0
    """TCP port; 0 picks a free one (the bound port is logged and returned)."""
    max_concurrent_rpcs: int = 64
    """In-flight calls (health checks excluded) past which new calls get RESOURCE_EXHAUSTED."""
    max_message_mb: int = 64
    """Largest request or response message in MiB, both directions."""
    grace_s: float = 30.0
    """Seconds that in-flight calls (and running jobs) get to finish on SIGTERM/SIGINT."""
    auth_token_file: str | None = None
    """File holding the bearer token clients must send; None turns authentication off."""
    tls_cert: str | None = None
    """PEM server certificate chain; with `tls_key` turns TLS on."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    tls_client_ca: str | None = None
    """PEM CA bundle that client certificates must chain to; set = mTLS (certs required)."""
    state_dir: str | None = None
    """Directory where operation records persist across restarts; None keeps them in memory."""
    log_level: str = "info"
    """One of debug, info, warning, error."""
    log_format: str = "text"
    """`text` (key=value lines) or `json` (one JSON object per line)."""
    metrics_port: int | None = None
    """Port of the Prometheus `/metrics` endpoint on `host` (0 = any free); None: no endpoint."""
    metrics_secure: bool = False
    """Give `/metrics` the service's TLS files and bearer token (else plain HTTP, no auth)."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host must not be empty (e.g. 127.0.0.1 or 0.0.0.0)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535] (0 = any free port), got {self.port}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"--max-concurrent-rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if not 1 <= self.max_message_mb <= MAX_MESSAGE_MB_LIMIT:
            raise ValueError(
                f"--max-message-mb must be in [1, {MAX_MESSAGE_MB_LIMIT}], got {self.max_message_mb}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"--metrics-port must be in [0, 65535] (0 = any free port), got {self.metrics_port}"
            )
        if self.metrics_secure and self.metrics_port is None:
            raise ValueError("--metrics-secure needs --metrics-port (the endpoint it secures)")
        if self.metrics_secure and self.tls_cert is None and self.auth_token_file is None:
            raise ValueError(
                "--metrics-secure reuses the server's --tls-cert/--tls-key and --auth-token-file; "
                "give at least one of them"
            )
        if self.grace_s < 0:
            raise ValueError(f"--grace-period must be >= 0 seconds, got {self.grace_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "--tls-cert and --tls-key go together: give both to enable TLS, or neither"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mTLS) needs TLS: also give --tls-cert and --tls-key")
        for flag, path in (
            ("--auth-token-file", self.auth_token_file),
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-client-ca", self.tls_client_ca),
        ):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path!r} is not a readable file; check the path")
        if (
            self.state_dir is not None
            and Path(self.state_dir).exists()
            and not Path(self.state_dir).is_dir()
        ):
            raise ValueError(f"--state-dir {self.state_dir!r} exists and is not a directory")

    @property
    def tls(self) -> bool:
        """Whether the server listens with TLS."""
        return self.tls_cert is not None

    @property
    def max_message_bytes(self) -> int:
        """`max_message_mb` in bytes, as gRPC's channel options want it."""
        return self.max_message_mb * 1024 * 1024


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Adds the server flags (`--host`, `--port`, ...) to a service's CLI parser."""
    d = ServerConfig()
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=d.host, help=f"interface to bind (default {d.host})")
    group.add_argument(
        "--port",
        type=int,
        default=default_port,
        help=f"TCP port, 0 = any free (default {default_port})",
    )
    group.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=d.max_concurrent_rpcs,
        help="in-flight calls past which new calls get RESOURCE_EXHAUSTED; health checks exempt "
        f"(default {d.max_concurrent_rpcs})",
    )
    group.add_argument(
        "--max-message-mb",
        type=int,
        default=d.max_message_mb,
        help=f"largest message in MiB, send and receive (default {d.max_message_mb})",
    )
    group.add_argument(
        "--grace-period",
        dest="grace_s",
        type=float,
        default=d.grace_s,
        help="seconds in-flight calls and running jobs get to finish on SIGTERM/SIGINT "
        f"(default {d.grace_s:g})",
    )
    group.add_argument(
        "--auth-token-file",
        default=None,
        help="file with the bearer token clients must send as 'authorization: Bearer <token>' "
        "(default: no authentication)",
    )
    group.add_argument(
        "--tls-cert", default=None, help="PEM server certificate chain (enables TLS)"
    )
    group.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    group.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA that client certificates must chain to; enables mTLS (client certs required)",
    )
    group.add_argument(
        "--state-dir",
        default=None,
        help="directory where operation records persist across restarts (default: memory only)",
    )
    group.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS, help="log verbosity")
    group.add_argument(
        "--log-format", default=d.log_format, choices=LOG_FORMATS, help="text or json log lines"
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)",
    )
    group.add_argument(
        "--metrics-secure",
        action="store_true",
        default=False,
        help="serve /metrics with the server's --tls-cert/--tls-key (HTTPS, mTLS with "
        "--tls-client-ca) and require its --auth-token-file token (default: plain HTTP, no auth)",
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Builds (and so validates) the ServerConfig from flags added by `add_server_flags`."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_message_mb=args.max_message_mb,
        grace_s=args.grace_s,
        auth_token_file=args.auth_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        state_dir=args.state_dir,
        log_level=args.log_level,
        log_format=args.log_format,
        metrics_port=args.metrics_port,
        metrics_secure=args.metrics_secure,
    )
