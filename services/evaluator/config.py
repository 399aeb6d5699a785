"""Settings of the evaluator gRPC service (the server's own; request fields live in the proto)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from services.common.data_roots import DataRootsConfig
from services.common.dataclass_flags import FlagSpec
from services.common.service_flags import add_service_flags, service_config

DEFAULT_PORT = 50055


@dataclass
class EvaluatorServiceConfig(DataRootsConfig):
    """What an evaluator server may touch (task data, checkpoints and output lie under
    `data_roots`), where results go, and its request limits."""

    output_root: Path | None = None
    """Where results go when a request gives no output_path; must lie under a --data-root
    (default: runs/eval under the first --data-root)."""
    max_batch_size: int = 256
    """Largest `batch_size` a request may ask for (default 256)."""
    max_new_tokens_limit: int = 4096
    """Largest `max_new_tokens` a request may ask for (default 4096)."""
    allow_unsafe_code_execution: bool = False
    """Run HumanEval's generated code even where this host cannot sandbox it in namespaces (then
    only rlimits and a separate uid contain it); see docs/security.md."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output_root is None:
            self.output_root = self.data_roots[0] / "runs" / "eval"
        self.output_root = Path(self.output_root).resolve()
        if not self.under_roots(self.output_root):
            raise ValueError(
                f"--output-root {str(self.output_root)!r} must lie under a --data-root "
                f"({', '.join(map(str, self.data_roots))})"
            )
        for flag, value in (
            ("--max-batch-size", self.max_batch_size),
            ("--max-new-tokens-limit", self.max_new_tokens_limit),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


FLAGS = ("output_root", "max_batch_size", "max_new_tokens_limit", "allow_unsafe_code_execution")
"""The fields that are `serve` flags (besides --data-root)."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the evaluator service's own flags to its `serve` parser."""
    # a string, so that an empty --output-root is told apart from "." (it means the default)
    specs = {"output_root": FlagSpec(metavar="DIR", extra={"type": str})}
    add_service_flags(
        parser, EvaluatorServiceConfig, "evaluator service", "request paths", FLAGS, specs
    )


def from_args(args: argparse.Namespace) -> EvaluatorServiceConfig:
    """Builds (and so validates) the config from the flags `add_flags` added (an empty
    --output-root means the default, as no flag does)."""
    args.output_root = args.output_root or None
    return service_config(args, EvaluatorServiceConfig)
