"""Settings of the evaluator gRPC service (the server's own; request fields live in the proto)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from services.common.data_roots import DataRootsConfig, add_data_root_flag, data_roots_from_args

DEFAULT_PORT = 50055


@dataclass
class EvaluatorServiceConfig(DataRootsConfig):
    """What an evaluator server may touch (task data, checkpoints and output lie under
    `data_roots`), where results go, and its request limits."""

    output_root: Path | None = None
    """Where results go when a request gives no output_path; None = `<first data root>/runs/eval`."""
    max_batch_size: int = 256
    """Largest `batch_size` a request may ask for."""
    max_new_tokens_limit: int = 4096
    """Largest `max_new_tokens` a request may ask for."""
    allow_unsafe_code_execution: bool = False
    """Run HumanEval's generated code even where the host cannot sandbox it in namespaces."""

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


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the evaluator service's own flags to its `serve` parser."""
    group = parser.add_argument_group("evaluator service")
    add_data_root_flag(group, "request paths")
    group.add_argument(
        "--output-root",
        default=None,
        help="where results go when a request gives no output_path; must lie under a "
        "--data-root (default: runs/eval under the first --data-root)",
    )
    group.add_argument(
        "--max-batch-size",
        type=int,
        default=256,
        help="largest batch_size a request may ask for (default 256)",
    )
    group.add_argument(
        "--max-new-tokens-limit",
        type=int,
        default=4096,
        help="largest max_new_tokens a request may ask for (default 4096)",
    )
    group.add_argument(
        "--allow-unsafe-code-execution",
        action="store_true",
        help="run HumanEval's generated code even where this host cannot sandbox it in "
        "namespaces (then only rlimits and a separate uid contain it); see docs/security.md",
    )


def from_args(args: argparse.Namespace) -> EvaluatorServiceConfig:
    """Builds (and so validates) the config from the flags `add_flags` added."""
    roots = data_roots_from_args(args)
    return EvaluatorServiceConfig(
        data_roots=roots,
        output_root=Path(args.output_root) if args.output_root else None,
        max_batch_size=args.max_batch_size,
        max_new_tokens_limit=args.max_new_tokens_limit,
        allow_unsafe_code_execution=args.allow_unsafe_code_execution,
    )
