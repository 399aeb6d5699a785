"""Writes and deletes that stay beneath an opened directory: no symlink followed, no escape.

A path checked against the data roots when a request arrives can be redirected afterwards: a
folder on shared storage swapped for a symlink makes a later `open(path, "w")` or
`shutil.rmtree(path)` act outside the root. Everything here works on directory descriptors
instead: a `Dir` is an opened directory, and every name below it is reached with `openat2`
(`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`) where the kernel has it (Linux 5.6+), else by a walk of
one `O_NOFOLLOW` open per component with `dir_fd=`. Either way a symlink anywhere below the
anchor is refused (`Escape`), `..` never leaves it, and a directory already opened stays the
same directory even if its path is swapped later.

Lives in a library (not `services/`) so the training code's metrics and trace writers can use
it; `services/common/safe_fs.py` is the service-facing API over it (request fields, roots).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any

ROOTS_ENV = "MESHLINE_DATA_ROOTS"
"""Set by a service for the processes it starts: the data roots, joined with `os.pathsep`."""

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on x86_64, aarch64 and the generic syscall table
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DEPTH = 256


class Escape(PermissionError):
    """A path below an anchor met a symlink or `..` (it could lead outside the anchor)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_openat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_BENEATH)
    fd = syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_long(-100),  # AT_FDCWD
        ctypes.c_char_p(b"."),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        return None  # ENOSYS (kernel before 5.6) or a seccomp filter: use the walk
    os.close(fd)
    return syscall


_openat2 = _load_openat2()


def has_openat2() -> bool:
    """Whether this kernel answers `openat2` (else every open is the component walk)."""
    return _openat2 is not None


def _parts(relative: str | os.PathLike[str]) -> list[str]:
    text = os.fspath(relative)
    if "\0" in text:
        raise Escape(errno.EINVAL, "path contains a NUL byte", text)
    path = PurePosixPath(text)
    if path.is_absolute():
        raise Escape(
            errno.EXDEV, "an absolute path where a path below the anchor was expected", text
        )
    parts = [p for p in path.parts if p != "."]
    if ".." in parts:
        raise Escape(errno.EXDEV, "'..' may not appear in a path below the anchor", text)
    if len(parts) > _MAX_DEPTH:
        raise Escape(errno.ENAMETOOLONG, f"more than {_MAX_DEPTH} components", text)
    return parts


def _refused(where: str, name: str) -> Escape:
    return Escape(
        errno.ELOOP,
        f"{name!r} is a symbolic link (or was swapped for one); links are not followed below "
        "the data root",
        where,
    )


class Dir:
    """An opened directory; every operation names paths relative to it and stays beneath it."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        """The directory descriptor (closed by `close` or leaving the `with` block)."""
        self.path = path
        """Where the directory was when it was opened (for messages; never reopened by path)."""

    @classmethod
    def open_anchor(cls, path: str | os.PathLike[str]) -> Dir:
        """Opens the trusted anchor directory itself (a data root: the operator's setting)."""
        return cls(
            os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), Path(path)
        )

    def close(self) -> None:
        """Closes the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def proc_path(self) -> str:
        """A path naming this very directory (`/proc/self/fd/N`), for libraries that take paths.

        Resolving it lands in the opened directory even if its original path was swapped since.
        """
        return f"/proc/self/fd/{self.fd}"

    # -- opening ---------------------------------------------------------------------------
    def open(self, relative: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
        """A descriptor for `relative` below this directory; `Escape` on any symlink or `..`."""
        parts = _parts(relative)
        if not parts:
            return os.dup(self.fd) if flags & os.O_DIRECTORY else self._fail_empty(relative)
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        if _openat2 is not None:
            return self._openat2("/".join(parts), flags, mode)
        parent = self._walk(parts[:-1], create=False)
        try:
            return self._open_leaf(parent, parts[-1], flags, mode)
        finally:
            if parent != self.fd:
                os.close(parent)

    def _fail_empty(self, relative: object) -> int:
        raise IsADirectoryError(errno.EISDIR, "names the anchor directory itself", str(relative))

    def _openat2(self, relative: str, flags: int, mode: int) -> int:
        how = _OpenHow(
            flags,
            mode if flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)) else 0,
            _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS,
        )
        fd = _openat2(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_long(self.fd),
            ctypes.c_char_p(relative.encode()),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        where = str(self.path / relative)
        if err in (errno.ELOOP, errno.EXDEV) or (err == errno.ENOTDIR and self._has_link(relative)):
            raise _refused(where, relative)
        raise OSError(err, os.strerror(err), where)

    def _has_link(self, relative: str) -> bool:
        """Whether a component of `relative` is a symlink (O_DIRECTORY on one says ENOTDIR)."""
        current = self.fd
        try:
            for name in relative.split("/"):
                if _is_link(current, name):
                    return True
                try:
                    opened = os.open(name, _DIR_FLAGS, dir_fd=current)
                except OSError:
                    return False
                if current != self.fd:
                    os.close(current)
                current = opened
            return False
        finally:
            if current != self.fd:
                os.close(current)

    def _open_leaf(self, parent: int, name: str, flags: int, mode: int) -> int:
        try:
            return os.open(name, flags, mode, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST) and _is_link(parent, name):
                raise _refused(str(self.path), name) from None
            raise

    def _walk(self, parts: Sequence[str], create: bool, mode: int = 0o777) -> int:
        """The descriptor of directory `parts` below this one (the caller closes it if new)."""
        current = self.fd
        try:
            for name in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, mode, dir_fd=current)
                try:
                    opened = os.open(name, _DIR_FLAGS, dir_fd=current)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(current, name):
                        raise _refused(str(self.path), name) from None
                    raise
                if current != self.fd:
                    os.close(current)
                current = opened
        except BaseException:
            if current != self.fd:
                os.close(current)
            raise
        return current

    def subdir(
        self, relative: str | os.PathLike[str], create: bool = False, mode: int = 0o777
    ) -> Dir:
        """The directory `relative` below this one, opened (created first when `create`)."""
        parts = _parts(relative)
        if not create and _openat2 is not None and parts:
            fd = self._openat2("/".join(parts), _DIR_FLAGS, 0)
        else:
            fd = self._walk(parts, create, mode)
            if fd == self.fd:
                fd = os.dup(fd)
        return Dir(fd, self.path.joinpath(*parts))

    def _parent(self, relative: str | os.PathLike[str]) -> tuple[Dir, str]:
        parts = _parts(relative)
        if not parts:
            raise IsADirectoryError(
                errno.EISDIR, "names the anchor directory itself", str(relative)
            )
        return self.subdir("/".join(parts[:-1])), parts[-1]

    def fdopen(
        self,
        relative: str | os.PathLike[str],
        mode: str = "r",
        encoding: str | None = None,
        newline: str | None = None,
        perms: int = 0o644,
    ) -> IO[Any]:
        """A Python file object for `relative` (`mode` as `open`'s: r, w, a, x, with b or +)."""
        flags = {
            "r": os.O_RDONLY,
            "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
            "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
            "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
        }[mode[0]]
        if "+" in mode:
            flags = (flags & ~os.O_WRONLY) | os.O_RDWR
        fd = self.open(relative, flags, perms)
        return os.fdopen(fd, mode, encoding=encoding, newline=newline)

    # -- writing ---------------------------------------------------------------------------
    def write_bytes(self, relative: str | os.PathLike[str], data: bytes) -> None:
        """Writes `data` to `relative` atomically (a temporary name, fsync, then rename)."""
        parent, name = self._parent(relative)
        with parent:
            tmp = f".{name}.tmp-{os.getpid()}"
            fd = parent.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.rename(tmp, name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=parent.fd)
                raise

    def write_text(self, relative: str | os.PathLike[str], text: str) -> None:
        """`write_bytes` of `text` in UTF-8."""
        self.write_bytes(relative, text.encode("utf-8"))

    def mkdir(self, relative: str | os.PathLike[str], mode: int = 0o777) -> None:
        """Creates `relative` and its missing parents below this directory (no error if there)."""
        self.subdir(relative, create=True, mode=mode).close()

    def rename(
        self, src: str | os.PathLike[str], dst: str | os.PathLike[str], dst_dir: Dir | None = None
    ) -> None:
        """Renames `src` (below this directory) to `dst` (below `dst_dir`, default this one)."""
        target = dst_dir or self
        src_parent, src_name = self._parent(src)
        with src_parent:
            dst_parent, dst_name = target._parent(dst)
            with dst_parent:
                os.rename(src_name, dst_name, src_dir_fd=src_parent.fd, dst_dir_fd=dst_parent.fd)

    # -- reading the tree ------------------------------------------------------------------
    def lstat(self, relative: str | os.PathLike[str]) -> os.stat_result | None:
        """`lstat` of `relative` (the link itself when it is one), or None when it is missing."""
        try:
            parent, name = self._parent(relative)
        except FileNotFoundError:
            return None
        with parent:
            try:
                return os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
            except FileNotFoundError:
                return None

    def listdir(self, relative: str | os.PathLike[str] = ".") -> list[str]:
        """Names in directory `relative` below this one."""
        with self.subdir(relative) as directory:
            return os.listdir(directory.fd)

    # -- deleting --------------------------------------------------------------------------
    def unlink(self, relative: str | os.PathLike[str], missing_ok: bool = True) -> None:
        """Removes the file or link `relative` (a link itself, never its target)."""
        try:
            parent, name = self._parent(relative)
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        with parent:
            try:
                os.unlink(name, dir_fd=parent.fd)
            except FileNotFoundError:
                if not missing_ok:
                    raise

    def rmtree(self, relative: str | os.PathLike[str], missing_ok: bool = True) -> None:
        """Removes directory `relative` and all it holds; links inside are unlinked, not followed.

        `relative` itself being a symlink (say, an output folder swapped for a link to another
        user's data) is refused with `Escape`: nothing outside is touched, the link stays.
        """
        try:
            parent, name = self._parent(relative)
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        with parent:
            if _is_link(parent.fd, name):
                raise _refused(str(parent.path), name)
            try:
                _rmtree_at(parent.fd, name, 0)
            except FileNotFoundError:
                if not missing_ok:
                    raise


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _rmtree_at(parent: int, name: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise OSError(errno.ELOOP, f"more than {_MAX_DEPTH} nested directories", name)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            os.unlink(name, dir_fd=parent)  # a file, or a link swapped in: remove the entry only
            return
        raise
    try:
        for entry in _scan(fd):
            if entry.is_dir(follow_symlinks=False):
                _rmtree_at(fd, entry.name, depth + 1)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _scan(fd: int) -> Iterator[os.DirEntry[str]]:
    with os.scandir(fd) as entries:
        yield from list(entries)


def roots_from_env(environ: dict[str, str] | None = None) -> tuple[Path, ...]:
    """The roots a service passed down in `ROOTS_ENV`; empty when not started by a service."""
    value = (os.environ if environ is None else environ).get(ROOTS_ENV, "")
    return tuple(Path(part) for part in value.split(os.pathsep) if part)


def anchor_of(path: str | os.PathLike[str], roots: Sequence[Path]) -> tuple[Path, str]:
    """(root, path relative to it) for `path` under the innermost of `roots` that holds it.

    With no roots (an operator's own run, no service) the anchor is `/` and `path` is resolved
    through symlinks first: links present now are the operator's own; a swap later is refused.
    Raises `Escape` when `path` lies under none of `roots`.
    """
    absolute = Path(os.path.abspath(os.fspath(path))) if roots else Path(os.path.realpath(path))
    if not roots:
        return Path("/"), str(absolute.relative_to("/"))
    real_roots = sorted((Path(os.path.realpath(r)) for r in roots), key=lambda r: -len(r.parts))
    for root in real_roots:
        if absolute == root or root in absolute.parents:
            return root, str(absolute.relative_to(root)) or "."
    raise Escape(errno.EXDEV, "lies under none of the data roots", str(absolute))


def open_dir_beneath(
    path: str | os.PathLike[str], roots: Sequence[Path] | None = None, create: bool = False
) -> Dir:
    """Directory `path` opened beneath its data root (`roots`, default `ROOTS_ENV`'s).

    Created (with its missing parents, none through a link) when `create`. The returned `Dir`
    keeps naming that directory even if its path is swapped for a symlink afterwards.
    """
    root, relative = anchor_of(path, roots_from_env() if roots is None else roots)
    with Dir.open_anchor(root) as anchor:
        return anchor.subdir(relative, create=create)
