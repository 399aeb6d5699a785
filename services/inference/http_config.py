"""Settings of the OpenAI-compatible HTTP front of the inference server, and their flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

CHAT_TEMPLATE_AUTO = "auto"


@dataclass
class HttpConfig:
    """Where the HTTP front listens and the limits it puts on requests.

    It binds the gRPC server's `--host` and uses the same `--auth-token-file` and TLS files.
    """

    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP API (0 = any free); None: gRPC only."""
    served_model_name: str | None = None
    """Model id clients send as `model` and `/v1/models` lists; None: the checkpoint's name."""
    chat_template: str = CHAT_TEMPLATE_AUTO
    """How chat messages become a prompt: "auto" (the tokenizer's own Jinja template) or a
    models/templates.py name (chatml, llama2-chat, vicuna, ...)."""
    max_request_mb: float = 16.0
    """Largest request body in MiB (413 past it)."""
    max_concurrent_requests: int = 64
    """HTTP requests in flight past which new ones get 429 (the health route is exempt)."""
    max_prompts: int = 256
    """Most prompts one /v1/completions request may carry (a batch of token lists counts each)."""

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


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the HTTP front's flags to the inference `serve` parser."""
    d = HttpConfig()
    group = parser.add_argument_group("OpenAI-compatible HTTP API")
    group.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models) "
        "on this port of --host, from the same engine (default: off)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send as 'model' (default: the checkpoint's name)",
    )
    group.add_argument(
        "--chat-template",
        default=d.chat_template,
        help="'auto' uses the tokenizer's chat template; or a prompt template name "
        "(chatml, llama2-chat, vicuna, alpaca, ...) (default auto)",
    )
    group.add_argument(
        "--http-max-request-mb",
        type=float,
        default=d.max_request_mb,
        help=f"largest HTTP request body in MiB, 413 past it (default {d.max_request_mb:g})",
    )
    group.add_argument(
        "--http-max-concurrent-requests",
        type=int,
        default=d.max_concurrent_requests,
        help=f"HTTP requests in flight past which new ones get 429 "
        f"(default {d.max_concurrent_requests})",
    )
    group.add_argument(
        "--http-max-prompts",
        type=int,
        default=d.max_prompts,
        help=f"most prompts in one /v1/completions request (default {d.max_prompts})",
    )


def http_config_from_args(args: argparse.Namespace) -> HttpConfig:
    """Builds (and so validates) the HttpConfig from the flags `add_http_flags` added."""
    return HttpConfig(
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        max_request_mb=args.http_max_request_mb,
        max_concurrent_requests=args.http_max_concurrent_requests,
        max_prompts=args.http_max_prompts,
    )
