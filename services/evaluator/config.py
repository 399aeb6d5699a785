"""Settings of the evaluator gRPC service (the server's own; request fields live in the proto)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 50055


def _default_roots() -> tuple[Path, ...]:
    return (Path.cwd(),)


@dataclass
class EvaluatorServiceConfig:
    """What an evaluator server may touch, where results go, and its request limits."""

    data_roots: tuple[Path, ...] = field(default_factory=_default_roots)
    """Directories that request paths (task data, checkpoints, output) must lie under."""
    output_root: Path | None = None
    """Where results go when a request gives no output_path; None = `<first data root>/runs/eval`."""
    max_batch_size: int = 256
    """Largest `batch_size` a request may ask for."""
    max_new_tokens_limit: int = 4096
    """Largest `max_new_tokens` a request may ask for."""
    allow_unsafe_code_execution: bool = False
    """Run HumanEval's generated code even where the host cannot sandbox it in namespaces."""

    def __post_init__(self) -> None:
        if not self.data_roots:
            raise ValueError("--data-root: give at least one directory (use / to allow any path)")
        self.data_roots = tuple(Path(root).resolve() for root in self.data_roots)
        for root in self.data_roots:
            if not root.is_dir():
                raise ValueError(f"--data-root {str(root)!r} is not an existing directory")
        if self.output_root is None:
            self.output_root = self.data_roots[0] / "runs" / "eval"
        self.output_root = Path(self.output_root).resolve()
        if not any(r == self.output_root or r in self.output_root.parents for r in self.data_roots):
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
    group.add_argument(
        "--data-root",
        dest="data_roots",
        action="append",
        default=None,
        metavar="DIR",
        help="directory request paths must lie under; repeatable (default: the current "
        "directory; / allows any path)",
    )
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
    roots = tuple(Path(p) for p in args.data_roots) if args.data_roots else _default_roots()
    return EvaluatorServiceConfig(
        data_roots=roots,
        output_root=Path(args.output_root) if args.output_root else None,
        max_batch_size=args.max_batch_size,
        max_new_tokens_limit=args.max_new_tokens_limit,
        allow_unsafe_code_execution=args.allow_unsafe_code_execution,
    )
