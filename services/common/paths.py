"""Confine request paths to the storage roots a service may touch: the one shared helper.

Requests carry paths on shared storage (DESIGN §1.6, §5b). A path is resolved with symlinks
followed (`os.path.realpath`) before it is compared with the roots, so neither `..` nor a
symlink that points outside can escape, and the *resolved* path is what a service passes on.
Storage can change after that check, so:

- `confine_to` / `confine_tree`: files found inside a folder a request names (globbed task
  files, a checkpoint's or tokenizer's contents) are confined too;
- `check_at_use`: worker processes re-resolve a path right before they use it, against the roots
  the service handed down in `ROOTS_ENV`;
- `open_resolved`: a file the service opens itself is opened with O_NOFOLLOW and the opened
  descriptor's real path compared with the resolved one, closing the check-then-open window.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from checkpoints.safe_fs import ROOTS_ENV, roots_from_env
from services.common.errors import InvalidArgument, PermissionDenied

__all__ = [
    "ROOTS_ENV",
    "check_at_use",
    "confine_to",
    "confine_tree",
    "open_resolved",
    "resolve_under_roots",
    "roots_env_value",
    "roots_from_env",
]


def resolve_under_roots(path: str, roots: Sequence[Path], field: str) -> Path:
    """The real path of `path` if it lies under one of `roots` (every path allowed when empty).

    Raises InvalidArgument for an empty path or one with a NUL byte, and PermissionDenied naming
    `field` and the allowed roots when the resolved path is outside all of them. The path need not
    exist yet (output locations), but its existing prefix is resolved through symlinks.
    """
    if not path:
        raise InvalidArgument(field, "is empty; give a path on the service's shared storage")
    if "\0" in path:
        raise InvalidArgument(field, "contains a NUL byte")
    resolved = Path(os.path.realpath(os.path.expanduser(path)))
    if not roots:
        return resolved
    real_roots = [Path(os.path.realpath(os.path.expanduser(root))) for root in roots]
    if any(resolved == root or root in resolved.parents for root in real_roots):
        return resolved
    allowed = ", ".join(str(root) for root in real_roots)
    raise PermissionDenied(
        f"{field}: {path!r} resolves to {str(resolved)!r}, outside the allowed roots ({allowed}); "
        "use a path under one of them"
    )


def roots_env_value(roots: Sequence[Path]) -> str:
    """The `ROOTS_ENV` value naming `roots` (for a child process's environment)."""
    return os.pathsep.join(str(root) for root in roots)


def check_at_use(path: str | os.PathLike[str], field: str) -> Path:
    """Re-resolves `path` right before it is used, against the roots in `ROOTS_ENV`.

    A path is checked when the request arrives, but a directory on shared storage can be swapped
    for a symlink afterwards; workers call this just before they write (or read) so the swap is
    refused with PermissionDenied instead of followed. Without `ROOTS_ENV` (an operator's own
    run, no service involved) every path is allowed, as in `resolve_under_roots`.
    """
    return resolve_under_roots(os.fspath(path), roots_from_env(), field)


def _opened_path(fd: int) -> Path | None:
    """The path the kernel holds for `fd` (Linux /proc), or None where that is unavailable."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def open_resolved(path: Path, field: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A file descriptor for the already-resolved `path`, refusing any symlink met at open time.

    The last component is opened with O_NOFOLLOW; then the path the kernel reports for the
    descriptor must still be `path`, which fails if a directory above it was swapped for a
    symlink between the check and the open. Raises PermissionDenied naming `field`.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionDenied(
                f"{field}: {str(path)!r} became a symbolic link after it was checked; "
                "symlinks are not followed at use time"
            ) from None
        raise
    opened = _opened_path(fd)
    if opened is None:
        same = os.path.samestat(os.fstat(fd), os.stat(os.path.realpath(path)))
        opened = path if same and os.path.realpath(path) == str(path) else Path("?")
    if opened != path:
        os.close(fd)
        raise PermissionDenied(
            f"{field}: {str(path)!r} now leads to {str(opened)!r} (a directory on the way was "
            "replaced by a symlink after the request was checked); refusing to use it"
        )
    return fd


def confine_to(path: Path, base: Path, field: str) -> Path:
    """The real path of `path` if it stays under `base` (a file found inside a request's folder).

    A folder a request names is confined to the roots, but a file inside it may be a symlink
    pointing anywhere; anything found by listing or globbing that folder goes through this.
    """
    return resolve_under_roots(str(path), (base,), field)


def confine_tree(path: Path, roots: Sequence[Path], field: str, max_entries: int = 100_000) -> None:
    """Refuses (PermissionDenied) a folder holding a symlink that leads outside `roots`.

    For folders a request names as a whole (a checkpoint, a tokenizer): the folder itself is
    confined by `resolve_under_roots`, but a `model.safetensors` inside it may be a symlink to
    another user's data or the service's secrets. Links are not followed while walking; at most
    `max_entries` entries are looked at (a larger tree is refused, naming the limit).
    """
    if not roots or not path.is_dir():
        return
    seen = 0
    for current, dirs, files in os.walk(path, followlinks=False):
        for name in (*dirs, *files):
            seen += 1
            if seen > max_entries:
                raise PermissionDenied(
                    f"{field}: {str(path)!r} holds more than {max_entries} entries; "
                    "point it at a single checkpoint or tokenizer folder"
                )
            entry = os.path.join(current, name)
            if os.path.islink(entry):
                resolve_under_roots(entry, roots, field)
