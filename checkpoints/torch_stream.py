"""A `torch.save` file written tensor by tensor: each tensor's bytes go to disk when it arrives,
the pickled structure that refers to them last, so a whole state dict never sits in memory.

The file is the zip archive `torch.save` writes (torch.serialization._save): `data/<key>` records
holding the storages, `data.pkl` (the object, with tensors rebuilt by
`torch._utils._rebuild_tensor_v2` from persistent ids `("storage", <Type>Storage, key, "cpu",
numel)`), `.format_version`, `.storage_alignment`, `byteorder`. Storages are written in key order
before `data.pkl` (torch.save writes `data.pkl` first); readers find records by name, and
`torch.load(weights_only=True, mmap=True)` reads the result like any other checkpoint.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from pathlib import Path
from typing import Any, cast

import torch
from torch.serialization import _get_storage_alignment, get_crc32_options

_PROTOCOL = 2  # torch.save's DEFAULT_PROTOCOL


class _StorageRef:
    """A storage already written as record `data/<key>`; pickled as a persistent id."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
        self.persistent = ("storage", storage_type, key, "cpu", numel)


class TensorRef:
    """Stands for a written tensor inside the object passed to `StreamingTorchFile.close`."""

    def __init__(self, storage: _StorageRef, shape: torch.Size, stride: tuple[int, ...]) -> None:
        self.storage, self.shape, self.stride = storage, shape, stride

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        args = (self.storage, 0, self.shape, self.stride, False, hooks)
        return (torch._utils._rebuild_tensor_v2, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.persistent if isinstance(obj, _StorageRef) else None


class StreamingTorchFile:
    """One `torch.save`-format file, open for tensors until `close(obj)` writes the structure."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer = torch._C.PyTorchFileWriter(
            str(path), get_crc32_options(), _get_storage_alignment()
        )
        self._next_key = 0
        self._closed = False

    def add(self, tensor: torch.Tensor) -> TensorRef:
        """Writes the tensor's bytes now; the returned ref goes where the tensor belongs in the
        object given to `close`. The tensor must own exactly its bytes (no view of a larger one)."""
        assert not self._closed, f"{self.path} is closed"
        storage = tensor.untyped_storage()
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        assert tensor.storage_offset() == 0 and storage.nbytes() == tensor.nbytes
        key = str(self._next_key)
        self._next_key += 1
        # torch.save passes the storage the same way (the stub only lists the legacy type)
        self._writer.write_record(f"data/{key}", cast(Any, storage), storage.nbytes())
        ref = _StorageRef(key, tensor.dtype, tensor.numel())
        return TensorRef(ref, tensor.shape, tensor.stride())

    def close(self, obj: Any) -> None:
        """Writes `obj` (holding TensorRefs where tensors go) and finishes the archive."""
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=_PROTOCOL).dump(obj)
        data = buffer.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        for name, text in (
            (".format_version", "1"),
            (".storage_alignment", str(_get_storage_alignment())),
            ("byteorder", sys.byteorder),
        ):
            self._writer.write_record(name, text.encode(), len(text))
        self._writer.write_end_of_file()
        self._closed = True

    def abandon(self) -> None:
        """Ends an unfinished file (it is not loadable; the caller deletes it)."""
        if not self._closed:
            self._writer.write_end_of_file()
            self._closed = True
