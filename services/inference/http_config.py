"""Settings of the OpenAI-compatible HTTP front of the inference server, and their flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from services.common.dataclass_flags import FlagSpec, add_fields, config_values

CHAT_TEMPLATE_AUTO = "auto"


@dataclass
class HttpConfig:
    """Where the HTTP front listens and the limits it puts on requests.

    It binds the gRPC server's `--host` and uses the same `--auth-token-file` and TLS files.
    """

    http_port: int | None = None
    """Also serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models) on
    this port of --host (0: any free port), from the same engine (default: off)."""
    served_model_name: str | None = None
    """Model id clients send as 'model' and /v1/models lists (default: the checkpoint's name)."""
    chat_template: str = CHAT_TEMPLATE_AUTO
    """How chat messages become a prompt: 'auto' uses the tokenizer's own chat template; or a
    prompt template name of models/templates.py (chatml, llama2-chat, vicuna, alpaca, ...)."""
    max_request_mb: float = 16.0
    """Largest HTTP request body in MiB, 413 past it."""
    max_concurrent_requests: int = 64
    """HTTP requests in flight past which new ones get 429 (the health route is exempt)."""
    max_prompts: int = 256
    """Most prompts in one /v1/completions request (a batch of token lists counts each)."""

    def __post_init__(self) -> None:
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(
                f"--http-port must be in [0, 65535] (0 = any free port), got {self.http_port}"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
        if not self.chat_template:
            raise ValueError("--chat-template must be 'auto' or a template name, e.g. chatml")
        if not 0 < self.max_request_mb <= 1024:
            raise ValueError(
                f"--http-max-request-mb must be in (0, 1024], got {self.max_request_mb}"
            )
        for flag, value in (
            ("--http-max-concurrent-requests", self.max_concurrent_requests),
            ("--http-max-prompts", self.max_prompts),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")

    @property
    def max_request_bytes(self) -> int:
        """`max_request_mb` in bytes."""
        return int(self.max_request_mb * 1024 * 1024)


FLAG_SPECS = {
    "max_request_mb": FlagSpec(flag="--http-max-request-mb"),
    "max_concurrent_requests": FlagSpec(flag="--http-max-concurrent-requests"),
    "max_prompts": FlagSpec(flag="--http-max-prompts"),
}
"""The HTTP limits' flags say HTTP (the gRPC server has its own --max-request-mb)."""


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the HTTP front's flags to the inference `serve` parser: one per `HttpConfig` field,
    its type, default and help text from the dataclass."""
    group = parser.add_argument_group("OpenAI-compatible HTTP API")
    names = [f.name for f in fields(HttpConfig)]
    add_fields(group, HttpConfig, names, FLAG_SPECS, show_defaults=True)


def http_config_from_args(args: argparse.Namespace) -> HttpConfig:
    """Builds (and so validates) the HttpConfig from the flags `add_http_flags` added."""
    return HttpConfig(**config_values(args, HttpConfig, FLAG_SPECS))
