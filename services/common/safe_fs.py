"""The service-facing API for writes and deletes under a data root (`checkpoints.safe_fs`).

Every write and delete a service does below its data roots goes through a directory opened
beneath its root (`open_dir`), never through a path re-resolved at use time: a folder swapped
for a symlink after the request was checked is refused with PERMISSION_DENIED naming the
request field, and nothing outside the root is created, written or deleted. The primitives live
in `checkpoints.safe_fs` so library code (the training loop's metrics and trace writers) can use
them too; this module adds the request field to the error and the service's roots.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from checkpoints.safe_fs import Dir, Escape, anchor_of, open_dir_beneath
from services.common.errors import PermissionDenied

__all__ = ["Dir", "Escape", "open_dir", "refused_as", "remove_tree"]


@contextlib.contextmanager
def refused_as(field: str) -> Iterator[None]:
    """Turns an `Escape` raised inside the block into PermissionDenied naming `field`."""
    try:
        yield
    except Escape as exc:
        raise PermissionDenied(
            f"{field}: {exc.filename!r}: {exc.strerror}; the path changed after the request was "
            "checked, refusing to write or delete through it"
        ) from None


def open_dir(
    path: str | os.PathLike[str], roots: Sequence[Path], field: str, create: bool = False
) -> Dir:
    """Directory `path` opened beneath the data root holding it (created when `create`).

    PermissionDenied naming `field` when a component is a symlink or the path is under none of
    `roots` (every path is allowed when `roots` is empty, anchored at `/`).
    """
    with refused_as(field):
        return open_dir_beneath(path, roots, create=create)


def remove_tree(path: str | os.PathLike[str], roots: Sequence[Path], field: str) -> None:
    """Removes directory `path` under its data root; links met are unlinked, never followed."""
    root, relative = anchor_of(path, roots)
    with refused_as(field), Dir.open_anchor(root) as anchor:
        anchor.rmtree(relative)
