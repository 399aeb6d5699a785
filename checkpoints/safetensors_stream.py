"""Read and write safetensors files one tensor at a time, so a shard never sits in memory whole.

The format is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape,
byte offsets) and the raw bytes. The header needs every tensor's shape and dtype up front; the
converter knows them before reading any weight (it plans on meta tensors), so it writes the
header first and then streams the data in header order. Reading copies each requested tensor's
bytes straight from the file into a fresh tensor (no memory map that would keep the file's pages
counted against the process), after checking the header against the file's size.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of a tensor that will be written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the tensor's data takes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


def shard(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Groups `specs`, in order, into shards of at most `max_bytes` (a bigger tensor alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


_NAME_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_MAX_HEADER = 100 * 1024**2


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """(tensor entries, data start offset) of a safetensors file, validated against its size."""
    size = path.stat().st_size
    with open(path, "rb") as stream:
        raw_len = stream.read(8)
        if len(raw_len) < 8:
            raise ValueError(f"{path} is not a readable safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER, size - 8):
            raise ValueError(
                f"{path} is not a readable safetensors file (header of {header_len} bytes in a "
                f"{size}-byte file)"
            )
        try:
            header = json.loads(stream.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a readable safetensors file (header is not a map)")
    header.pop("__metadata__", None)
    start = 8 + header_len
    for name, entry in header.items():
        try:
            spec = TensorSpec(name, _NAME_DTYPES[entry["dtype"]], tuple(entry["shape"]))
            begin, end = (int(offset) for offset in entry["data_offsets"])
            if not all(type(d) is int and d >= 0 for d in spec.shape):
                raise ValueError("shape dimensions must be non-negative integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: tensor {name!r} has a malformed entry {entry!r}") from exc
        if end - begin != spec.nbytes or begin < 0:
            raise ValueError(f"{path}: tensor {name!r} has offsets that do not fit its shape")
        if start + end > size:
            raise ValueError(
                f"{path}: tensor {name!r} ends at byte {start + end} but the file has {size} "
                "bytes; the file is truncated"
            )
    return header, start


def read_tensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors file, each read into its own memory."""
    header, start = read_header(path)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as stream:
        for name in names:
            if name not in header:
                raise ValueError(f"{path} has no tensor {name!r}")
            entry = header[name]
            tensor = torch.empty(entry["shape"], dtype=_NAME_DTYPES[entry["dtype"]])
            stream.seek(start + entry["data_offsets"][0])
            if tensor.numel():
                view = tensor.view(-1).view(torch.uint8).numpy()
                if stream.readinto(view.data) != view.nbytes:
                    raise ValueError(f"{path}: tensor {name!r} is cut short; truncated file")
            out[name] = tensor
    return out


class StreamingWriter:
    """One safetensors file: the header at construction, then `write` each tensor in spec order."""

    def __init__(
        self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None
    ) -> None:
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        for spec in specs:
            if spec.dtype not in _DTYPE_NAMES:
                raise ValueError(f"{path}: {spec.name} has dtype {spec.dtype}, not storable")
            header[spec.name] = {
                "dtype": _DTYPE_NAMES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
        self.path = path
        self._pending = list(specs)
        self._stream: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._stream.write(struct.pack("<Q", len(raw)))
        self._stream.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Appends `tensor`'s bytes; it must be the next spec's name, shape and dtype."""
        if not self._pending:
            raise ValueError(f"{self.path}: {name} written after the last planned tensor")
        spec = self._pending.pop(0)
        if (spec.name, spec.dtype, tuple(spec.shape)) != (name, tensor.dtype, tuple(tensor.shape)):
            raise ValueError(
                f"{self.path}: expected {spec.name} {spec.dtype} {tuple(spec.shape)} next, got "
                f"{name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._stream.write(data.view(torch.uint8).numpy().data)

    @property
    def complete(self) -> bool:
        """Whether every planned tensor has been written."""
        return not self._pending

    def abandon(self) -> None:
        """Closes the file without the completeness check (after a failure elsewhere)."""
        self._stream.close()

    def close(self) -> None:
        """Closes the file; raises if tensors are missing (the file would be unreadable)."""
        self._stream.close()
        if self._pending:
            raise ValueError(
                f"{self.path}: closed with {len(self._pending)} planned tensors unwritten "
                f"(first: {self._pending[0].name})"
            )
