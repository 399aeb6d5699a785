"""Structural checks of DCP `Metadata` read from an untrusted checkpoint.

The allow-listed unpickler guarantees only which classes exist; their fields can still hold
anything. Before torch's reader or a caller uses the metadata, this checks that every field has
the type DCP writes, every storage file is a plain file of the checkpoint directory (no `..`, no
absolute path, no symlink), every item's byte range lies inside its file without overlapping
another, and every tensor's declared size is backed by at least as many stored bytes, so no
size taken from the metadata can make a reader allocate more than the checkpoint holds.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

MAX_DIMS = 16
"""Most dimensions a stored tensor may declare."""


class _Invalid(ValueError):
    pass


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise _Invalid(what)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _check_shape(value: Any, what: str) -> tuple[int, ...]:
    _require(type(value) is torch.Size, f"{what} is a {type(value).__name__}, not torch.Size")
    _require(len(value) <= MAX_DIMS, f"{what} has {len(value)} dimensions (at most {MAX_DIMS})")
    _require(all(_is_int(d) and d >= 0 for d in value), f"{what} has a negative dimension")
    return tuple(value)


def _check_storage(
    index: Any, info: Any, directory: Path, file_sizes: dict[str, int]
) -> tuple[str, int, int]:
    _require(type(index) is MetadataIndex, f"storage key {index!r} is not a MetadataIndex")
    _require(type(index.fqn) is str, f"storage key {index!r} has a non-string name")
    if index.offset is not None:
        _check_shape(index.offset, f"storage key {index.fqn!r} offset")
    _require(type(info) is _StorageInfo, f"storage of {index.fqn!r} is not a _StorageInfo")
    name = info.relative_path
    _require(
        type(name) is str
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and "\0" not in name,
        f"storage of {index.fqn!r} names file {name!r}, which is not a plain file name inside "
        "the checkpoint directory",
    )
    _require(
        _is_int(info.offset) and _is_int(info.length) and info.offset >= 0 and info.length >= 0,
        f"storage of {index.fqn!r} has a malformed byte range",
    )
    _require(
        not getattr(info, "transform_descriptors", None),
        f"storage of {index.fqn!r} needs stream transforms {info.transform_descriptors!r}; "
        "only untransformed DCP files are read",
    )
    if name not in file_sizes:
        try:
            mode = os.lstat(directory / name)
        except FileNotFoundError:
            raise _Invalid(f"storage file {name!r} of {index.fqn!r} is missing") from None
        _require(stat.S_ISREG(mode.st_mode), f"storage file {name!r} is not a regular file")
        file_sizes[name] = mode.st_size
    _require(
        info.offset + info.length <= file_sizes[name],
        f"storage of {index.fqn!r} ends at byte {info.offset + info.length} of {name!r}, which "
        f"has {file_sizes[name]} bytes (truncated file?)",
    )
    return name, info.offset, info.length


def _check_tensor(fqn: str, item: TensorStorageMetadata, lengths: dict[Any, int]) -> None:
    props = item.properties
    _require(type(props) is TensorProperties, f"{fqn!r} has malformed tensor properties")
    _require(type(props.dtype) is torch.dtype, f"{fqn!r} has dtype {props.dtype!r}")
    size = _check_shape(item.size, f"{fqn!r} size")
    _require(type(item.chunks) is list, f"{fqn!r} chunks are not a list")
    itemsize = props.dtype.itemsize
    covered = 0
    for chunk in item.chunks:
        _require(type(chunk) is ChunkStorageMetadata, f"{fqn!r} has a malformed chunk")
        offsets = _check_shape(chunk.offsets, f"{fqn!r} chunk offsets")
        sizes = _check_shape(chunk.sizes, f"{fqn!r} chunk sizes")
        _require(
            len(offsets) == len(sizes) == len(size)
            and all(o + s <= d for o, s, d in zip(offsets, sizes, size, strict=True)),
            f"{fqn!r} has a chunk at {offsets} of {sizes} outside its size {size}",
        )
        numel = math.prod(sizes)
        stored = lengths.get(MetadataIndex(fqn, chunk.offsets))
        if stored is None:
            raise _Invalid(f"{fqn!r} chunk at {offsets} has no storage entry")
        _require(
            stored >= numel * itemsize,
            f"{fqn!r} chunk at {offsets} declares {numel * itemsize} bytes but stores {stored}",
        )
        covered += numel
    _require(
        covered >= math.prod(size),
        f"{fqn!r} declares size {size} but its chunks hold only {covered} elements",
    )


def _check_storage_meta(meta: Any) -> None:
    if meta is None:
        return
    _require(type(meta) is StorageMeta, "storage_meta is not a StorageMeta")
    _require(
        meta.checkpoint_id is None or isinstance(meta.checkpoint_id, str | os.PathLike),
        "storage_meta.checkpoint_id is not a path",
    )
    for field in ("save_id", "load_id"):
        value = getattr(meta, field)
        _require(value is None or type(value) is str, f"storage_meta.{field} is not a string")
    _require(
        type(meta.modules) is list and all(type(m) is str for m in meta.modules),
        "storage_meta.modules is not a list of names",
    )


def _check_planner_data(data: Any) -> None:
    if data is None:
        return
    _require(type(data) is dict, "planner_data is not a dict")
    for key, path in data.items():
        _require(
            type(key) is str
            and type(path) in (tuple, list)
            and all(type(p) in (str, int) for p in path),
            f"planner_data entry {key!r} is not a path of names",
        )


def check_metadata(metadata: Any, source: Path, directory: Path) -> None:
    """Raise ValueError naming `source` and the first malformed part of `metadata`."""
    try:
        _require(type(metadata) is Metadata, f"holds {type(metadata).__name__}, not DCP Metadata")
        _require(
            metadata.version is None or type(metadata.version) is str, "version is not a string"
        )
        _check_storage_meta(metadata.storage_meta)
        _check_planner_data(metadata.planner_data)
        storage = metadata.storage_data
        _require(type(storage) is dict, "storage_data is not a dict")
        file_sizes: dict[str, int] = {}
        lengths: dict[Any, int] = {}
        ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for index, info in storage.items():
            name, offset, length = _check_storage(index, info, directory, file_sizes)
            lengths[index] = length
            ranges[name].append((offset, offset + length))
        for name, spans in ranges.items():
            spans.sort()
            for (_, end), (begin, _) in itertools.pairwise(spans):
                _require(begin >= end, f"items overlap in storage file {name!r}")
        items = metadata.state_dict_metadata
        _require(type(items) is dict, "state_dict_metadata is not a dict")
        for fqn, item in items.items():
            _require(type(fqn) is str, f"state_dict_metadata key {fqn!r} is not a string")
            if type(item) is BytesStorageMetadata:
                _require(MetadataIndex(fqn) in lengths, f"bytes item {fqn!r} has no storage")
            else:
                _require(type(item) is TensorStorageMetadata, f"{fqn!r} has an unknown item type")
                _check_tensor(fqn, item, lengths)
    except _Invalid as exc:
        raise ValueError(f"{source} is not valid DCP metadata: {exc}") from None
    except (TypeError, AttributeError, OverflowError) as exc:
        raise ValueError(f"{source} is not valid DCP metadata ({exc})") from None
