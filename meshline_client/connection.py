"""Where a Meshline server is and how to reach it: address, deadline, retries, auth, TLS."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.client import make_channel

RETRYABLE = ("UNAVAILABLE",)


@dataclass(frozen=True)
class Connection:
    """Settings of one client channel."""

    address: str
    """"host:port" of the server (its --host/--port)."""
    token: str | None = None
    """Bearer token (the server's --auth-token-file), or None when auth is off."""
    tls_ca: str | Path | None = None
    """PEM CA the server's certificate chains to; set (or `use_tls`) for TLS."""
    client_cert: str | Path | None = None
    """PEM client certificate for mTLS (with `client_key`)."""
    client_key: str | Path | None = None
    """PEM private key of `client_cert`."""
    use_tls: bool | None = None
    """Force TLS on (system roots) or off; None: on when any TLS file is given."""
    timeout_s: float = 60.0
    """Deadline of each call unless the call gives its own."""
    max_attempts: int = 5
    """Attempts per call when the server answers UNAVAILABLE (gRPC retry policy, with backoff)."""
    initial_backoff_s: float = 0.2
    """First retry delay; later ones grow 2x up to 5 s (with gRPC's jitter)."""

    def __post_init__(self) -> None:
        if not self.address or ":" not in self.address:
            raise ValueError(f"address must be 'host:port', got {self.address!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 1 <= self.max_attempts <= 5:
            raise ValueError(
                f"max_attempts must be in [1, 5] (gRPC's cap), got {self.max_attempts}"
            )

    def service_config(self) -> str:
        """gRPC service config JSON: retry UNAVAILABLE on every method."""
        policy = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s}s",
            "maxBackoff": "5s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": list(RETRYABLE),
        }
        config = {"methodConfig": [{"name": [{}], "retryPolicy": policy}]}
        return json.dumps(config) if self.max_attempts > 1 else json.dumps({"methodConfig": []})

    def channel(self) -> grpc.Channel:
        """A blocking channel with the retry policy, token and TLS settings."""
        return make_channel(  # type: ignore[return-value]
            self.address,
            token=self.token,
            tls_ca=self.tls_ca,
            client_cert=self.client_cert,
            client_key=self.client_key,
            use_tls=self.use_tls,
            aio=False,
            options=[("grpc.enable_retries", 1), ("grpc.service_config", self.service_config())],
        )
