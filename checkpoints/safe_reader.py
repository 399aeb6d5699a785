"""A DCP filesystem reader that never unpickles arbitrary objects.

DCP stores its `.metadata` with `pickle`, and torch's reader hands every item saved as bytes
to an unrestricted `torch.load` (weights_only off); either would let a crafted checkpoint run
code. This reader closes both:

- `.metadata` is unpickled twice. The first pass resolves every global against an exact
  (module, name) allow-list of the classes DCP metadata is built from (no module prefixes, no
  dotted names, no persistent ids) and builds only inert stand-ins, so a refused class is
  reported, naming the file and the class, before any real object exists. The second pass builds
  the metadata from the same allow-list, and `metadata_check` validates its structure, file
  names and sizes against the files on disk.
- Bytes items are decoded with `torch.load(weights_only=True)` (tensors and plain values only)
  before torch's planner sees them.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlanner

from checkpoints.metadata_check import check_metadata

MAX_METADATA_BYTES = 512 * 1024**2
"""Largest `.metadata` file read (a 400B-parameter model's is tens of MB)."""

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DTYPE_NAMES = frozenset(
    name for name, value in vars(torch).items() if isinstance(value, torch.dtype)
)
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        # torch.layout pickles as _get_layout("torch.strided"): a lookup in a dict of layouts.
        ("torch.serialization", "_get_layout"),
        # StorageMeta.checkpoint_id is the path the checkpoint was saved to.
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),
        *(("torch", name) for name in _DTYPE_NAMES),
    }
)
"""Every (module, name) a DCP `.metadata` pickle may name; nothing else is resolved."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names a class outside the allow-list (it is corrupted or hostile)."""


class _Inert:
    """What the checking pass builds for an allowed global: accepts any arguments, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves only `ALLOWED_GLOBALS`; with `inert=True` builds stand-ins instead of them."""

    def __init__(self, data: bytes, source: Path, inert: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source
        self.inert = inert

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(
                f"{self.source}: checkpoint metadata refers to {module}.{name}, which is not a "
                "DCP metadata type; refusing to load it before building anything (the file is "
                "corrupted or not trusted; re-save the checkpoint with Meshline or torch DCP)"
            )
        if self.inert:
            return _Inert
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"{self.source}: checkpoint metadata holds a persistent id, which DCP never writes; "
            "refusing to load it"
        )


def load_metadata_file(path: Path) -> Metadata:
    """The `Metadata` in DCP metadata file `path`, read without arbitrary unpickling.

    Raises UnsafeCheckpointError (a ValueError) naming the file and the class for a refused
    global, ValueError for any other malformed content, FileNotFoundError when it is missing.
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {path.parent} is not a complete DCP checkpoint"
        )
    size = path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise ValueError(
            f"{path} is {size} bytes, more than any DCP metadata ({MAX_METADATA_BYTES}); refused"
        )
    with open(path, "rb") as stream:
        data = stream.read(MAX_METADATA_BYTES + 1)
    for inert in (True, False):
        try:
            metadata = _AllowListUnpickler(data, path, inert).load()
        except UnsafeCheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not readable DCP metadata ({exc})") from exc
        except (IndexError, KeyError, RecursionError, OverflowError, MemoryError) as exc:
            raise ValueError(f"{path} is not readable DCP metadata ({type(exc).__name__})") from exc
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` with allow-listed, validated metadata and weights-only bytes items."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read `.metadata` (or a rank's `__<rank>.metadata`) safely and check it against the
        files of the checkpoint."""
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = load_metadata_file(path)
        check_metadata(metadata, path, Path(os.fspath(self.path)))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """torch's read path, with bytes items decoded weights-only before the planner's
        `load_bytes` (which would otherwise unpickle them with weights_only off)."""
        wrapped = _WeightsOnlyBytes(planner, Path(os.fspath(self.path)))
        return super().read_data(plan, cast(LoadPlanner, wrapped))


class _WeightsOnlyBytes:
    """Wraps a load planner: `load_bytes` gets a re-serialisation of a weights-only decode, so
    the planner's own unrestricted `torch.load` only ever sees objects this process made."""

    def __init__(self, planner: Any, directory: Path) -> None:
        self._planner = planner
        self._directory = directory

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            decoded = torch.load(value, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UnsafeCheckpointError(
                f"{self._directory}: item {fqn!r} is not tensors and plain values ({first}); "
                "refusing to load it"
            ) from exc
        clean = io.BytesIO()
        torch.save(decoded, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
