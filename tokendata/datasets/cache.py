"""Build index arrays once, cache them as `.npy` beside the data, and share them across ranks.

With a process group, rank 0 of the group builds (if the cache misses) while the others wait on
a broadcast that also carries rank 0's error, so a failed build fails every rank instead of
hanging them. Without a group (independent processes, e.g. DataLoader-less tools or several jobs
on one machine) an exclusive file lock serialises the build. Arrays are written under temporary
names and renamed; the description file is written last and marks the entry complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

BuildFn = Callable[[], dict[str, np.ndarray]]


def description_hash(description: dict[str, Any]) -> str:
    """Stable short hash of a JSON-able description (the cache key)."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def default_cache_dir(path_prefix: str, cache_dir: str | None) -> Path:
    """`cache_dir` if given, else `cache/` in the directory holding the shard."""
    return Path(cache_dir) if cache_dir else Path(path_prefix).parent / "cache"


class IndexCache:
    """One cache entry: `{dir}/{stem}-{hash}-{name}.npy` arrays plus `...-description.json`."""

    def __init__(
        self, directory: Path, stem: str, description: dict[str, Any], names: tuple[str, ...]
    ):
        self.directory = Path(directory)
        self.description = description
        self.names = names
        self.base = f"{stem}-{description_hash(description)}"

    def path(self, name: str) -> Path:
        """File of one array of this entry."""
        return self.directory / f"{self.base}-{name}.npy"

    @property
    def description_path(self) -> Path:
        """Completion marker and human-readable record of what was built."""
        return self.directory / f"{self.base}-description.json"

    def complete(self) -> bool:
        """Whether every array and the marker exist."""
        return self.description_path.is_file() and all(self.path(n).is_file() for n in self.names)

    def _write(self, arrays: dict[str, np.ndarray]) -> None:
        missing = set(self.names) - set(arrays)
        assert not missing, f"index builder did not return {sorted(missing)}"
        self.directory.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            tmp = self.path(name).with_suffix(f".tmp{os.getpid()}.npy")
            np.save(tmp, arrays[name], allow_pickle=False)
            os.replace(tmp, self.path(name))
        tmp = self.description_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.description, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.description_path)

    def load(self) -> dict[str, np.ndarray]:
        """Memory-map the arrays of a complete entry."""
        return {n: np.load(self.path(n), mmap_mode="r", allow_pickle=False) for n in self.names}

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"{self.base}.lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def get_or_build(
        self, build: BuildFn, group: dist.ProcessGroup | None = None
    ) -> dict[str, np.ndarray]:
        """The cached arrays, building them first where missing (once per group or machine)."""
        if group is not None:
            return self._build_on_group(build, group)
        try:
            with self._file_lock():
                if not self.complete():
                    self._write(build())
                return self.load()
        except PermissionError as error:
            raise PermissionError(
                f"cannot write the sample-index cache in {self.directory} ({error}); point "
                "--data-cache-path at a writable directory"
            ) from error

    def _build_on_group(self, build: BuildFn, group: dist.ProcessGroup) -> dict[str, np.ndarray]:
        leader = dist.get_global_rank(group, 0)
        status: list[str | None] = [None]
        failure: Exception | None = None
        if dist.get_rank() == leader and not self.complete():
            try:
                self._write(build())
            except Exception as error:  # re-raised on every rank below
                failure = error
                status[0] = f"{type(error).__name__}: {error}"
        dist.broadcast_object_list(status, src=leader, group=group)
        if failure is not None:
            raise failure
        if status[0] is not None:
            raise RuntimeError(
                f"building the sample index {self.base} on rank {leader} failed: {status[0]}"
            )
        if not self.complete():
            raise FileNotFoundError(
                f"rank {dist.get_rank()} cannot see the sample index rank {leader} wrote to "
                f"{self.directory}; put --data-cache-path on storage every rank shares"
            )
        return self.load()


class CachedArraysMixin:
    """Pickles a dataset without its cached index arrays; the copy re-maps them from disk.

    DataLoader workers started with `spawn` would otherwise receive full copies of indices that
    can reach gigabytes. The arrays are attributes named like the cache entry's arrays.
    """

    _cache: IndexCache | None

    def adopt(self, arrays: dict[str, np.ndarray], cache: IndexCache | None) -> None:
        """Keep `arrays` as attributes and remember where they came from."""
        self._cache = cache
        for name, array in arrays.items():
            setattr(self, name, array)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._cache is not None:
            for name in self._cache.names:
                state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._cache is not None:
            self.adopt(self._cache.load(), self._cache)
