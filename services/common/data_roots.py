"""The `--data-root` setting every job service shares: flag, typed config field, path resolution.

A job service touches storage only under its data roots (DESIGN §1.6): the operator names them
with the repeatable `--data-root DIR` (default: the server's working directory; `/` allows any
path), and every path a request carries is resolved under them by `DataRootsConfig.resolve`
(`paths.resolve_under_roots`: symlinks followed, escapes refused with PERMISSION_DENIED naming
the field and the roots). Service configs inherit `DataRootsConfig`, so the field comes first
and is validated before the service's own fields.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from services.common.paths import resolve_under_roots


def default_data_roots() -> tuple[Path, ...]:
    """The roots when no `--data-root` is given: the server's working directory."""
    return (Path.cwd(),)


def check_data_roots(roots: tuple[Path, ...]) -> tuple[Path, ...]:
    """`roots` resolved to real paths; ValueError naming `--data-root` when empty or missing."""
    if not roots:
        raise ValueError("--data-root: give at least one directory (use / to allow any path)")
    resolved = tuple(Path(root).resolve() for root in roots)
    for root in resolved:
        if not root.is_dir():
            raise ValueError(f"--data-root {str(root)!r} is not an existing directory")
    return resolved


class ArgumentGroup(Protocol):
    """An argparse parser or argument group (anything with `add_argument`)."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """Adds one flag."""
        ...


@dataclass
class DataRootsConfig:
    """The data roots of a job service; its own config dataclass inherits this one."""

    data_roots: tuple[Path, ...] = field(default_factory=default_data_roots)
    """Directories that request paths must lie under (resolved through symlinks; / allows any)."""

    def __post_init__(self) -> None:
        self.data_roots = check_data_roots(self.data_roots)

    def resolve(self, path: str, field_name: str) -> Path:
        """The real path of request field `field_name` = `path`, if it lies under a data root.

        InvalidArgument for an empty path or one with a NUL byte, PermissionDenied naming the
        field and the roots for one outside them (`paths.resolve_under_roots`).
        """
        return resolve_under_roots(path, self.data_roots, field_name)

    def under_roots(self, path: Path) -> bool:
        """Whether the already-resolved `path` is a data root or lies under one."""
        return any(root == path or root in path.parents for root in self.data_roots)


def add_data_root_flag(group: ArgumentGroup, what: str = "request paths") -> None:
    """Adds the repeatable `--data-root DIR` flag; `what` says which paths must lie under it."""
    group.add_argument(
        "--data-root",
        dest="data_roots",
        action="append",
        default=None,
        metavar="DIR",
        help=f"directory that {what} must lie under; repeatable (default: the current "
        "directory; / allows any path)",
    )


def data_roots_from_args(args: argparse.Namespace) -> tuple[Path, ...]:
    """The roots named by the `--data-root` flags `add_data_root_flag` added (or the default)."""
    return tuple(Path(p) for p in args.data_roots) if args.data_roots else default_data_roots()
