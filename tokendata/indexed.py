"""Megatron-compatible memory-mapped token shards: `{prefix}.bin` (tokens) + `{prefix}.idx` (index).

The `.idx` layout (little endian), byte-identical to megatron-core's `IndexedDatasetBuilder`:

    b"MMIDIDX\\x00\\x00"      9-byte magic
    u64 version            always 1
    u8  dtype code         see `DTYPE_CODES`
    u64 N                  number of sequences
    u64 M                  number of document boundaries (documents + 1)
    i32[N]                 tokens per sequence
    i64[N]                 byte offset of each sequence in `.bin`
    i64[M]                 sequence index where each document starts (first 0, last N)

A document is usually one sequence; `add_document(ids, lengths=...)` stores several sequences (for
example sentences) as one document, as Megatron's `--split-sentences` does.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokendata.token_batches import (
    as_arrays,
    batch_index,
    concat_tokens,
    document_sizes,
    slice_bounds,
)

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8

# Megatron's numeric dtype codes (megatron.core.datasets.indexed_dataset.DType).
DTYPE_CODES: dict[str, int] = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}
_CODE_TO_DTYPE = {code: np.dtype(name) for name, code in DTYPE_CODES.items()}
_PARTIAL_SUFFIX = ".partial"
WRITE_BATCH_BYTES = 1 << 22
"""Converted documents are written to the .bin in batches of about this many bytes."""


def best_dtype(vocab_size: int | None) -> np.dtype:
    """Smallest token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dataset_prefix(output_prefix: str | os.PathLike[str], key: str, level: str = "document") -> str:
    """Megatron's shard name for one JSON key: `{output_prefix}_{key}_{level}`."""
    if level not in ("document", "sentence"):
        raise ValueError(
            f"level={level!r} is not a Megatron shard level; use 'document' or 'sentence'"
        )
    return f"{os.fspath(output_prefix)}_{key}_{level}"


def bin_path(path_prefix: str | os.PathLike[str]) -> Path:
    """Path of the token file for a shard prefix."""
    return Path(f"{os.fspath(path_prefix)}.bin")


def idx_path(path_prefix: str | os.PathLike[str]) -> Path:
    """Path of the index file for a shard prefix."""
    return Path(f"{os.fspath(path_prefix)}.idx")


def _resolve_dtype(dtype: Any) -> np.dtype:
    resolved = np.dtype(dtype)
    if resolved.name not in DTYPE_CODES:
        raise ValueError(
            f"dtype {resolved.name!r} cannot be stored in a Megatron indexed dataset; "
            f"use one of {sorted(DTYPE_CODES)}"
        )
    return resolved


class IndexedDatasetWriter:
    """Streams documents into `{prefix}.bin/.idx`; the files appear (atomically) on `finalize()`.

    Both files are written under `.partial` names and renamed at the end, `.idx` last, so a
    reader never sees a shard that looks complete but is not. Use as a context manager to
    discard the partial files when an exception escapes.
    """

    def __init__(self, path_prefix: str | os.PathLike[str], dtype: Any = np.int32) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.dtype = _resolve_dtype(dtype)
        self._bin_final = bin_path(self.path_prefix)
        self._idx_final = idx_path(self.path_prefix)
        self._bin_partial = Path(f"{self._bin_final}{_PARTIAL_SUFFIX}")
        self._idx_partial = Path(f"{self._idx_final}{_PARTIAL_SUFFIX}")
        self._bin_final.parent.mkdir(parents=True, exist_ok=True)
        self._bin_file = open(self._bin_partial, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._sequence_lengths = array("i")
        self._document_indices = array("q", [0])
        self._num_tokens = 0
        self._closed = False
        self._pending: list[np.ndarray] = []
        self._pending_bytes = 0
        self._safe_casts: dict[np.dtype, bool] = {}
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._id_range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._id_range = None

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return self._num_tokens

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"IndexedDatasetWriter({self.path_prefix!r}) is already finalized")

    def _as_tokens(self, ids: Any) -> np.ndarray:
        raw = ids if type(ids) is np.ndarray else np.asarray(ids)
        if raw.ndim != 1:
            raise ValueError(
                f"{self.path_prefix}: a document must be a 1-D sequence of token ids, "
                f"got shape {raw.shape}"
            )
        if raw.dtype == self.dtype:
            return raw
        # A safe cast (e.g. uint16 -> int32) cannot overflow; anything else is range-checked.
        if self._id_range is not None and raw.size and not self._safe_cast(raw.dtype):
            if raw.dtype.kind not in "iub":
                raise ValueError(
                    f"{self.path_prefix}: token ids must be integers, got dtype {raw.dtype}"
                )
            tokens = raw.astype(self.dtype)
            if raw.dtype == np.int64:
                # Every id survived iff widening back to int64 (exact for every stored integer
                # dtype) gives the same bytes: a copy and a memcmp, cheaper than a reduction.
                fits = tokens.astype(np.int64).tobytes() == raw.tobytes()
            else:
                low, high = int(raw.min()), int(raw.max())
                fits = self._id_range[0] <= low and high <= self._id_range[1]
            if not fits:
                low, high = int(raw.min()), int(raw.max())
                raise ValueError(
                    f"{self.path_prefix}: token ids span [{low}, {high}] which does not fit "
                    f"dtype {self.dtype.name} {list(self._id_range)}; pick a wider dtype "
                    "(best_dtype(vocab_size))"
                )
            return tokens
        return raw.astype(self.dtype)

    def _safe_cast(self, dtype: np.dtype) -> bool:
        safe = self._safe_casts.get(dtype)
        if safe is None:
            safe = self._safe_casts[dtype] = bool(np.can_cast(dtype, self.dtype))
        return safe

    def add_document(self, ids: Any, lengths: Sequence[int] | None = None) -> None:
        """Append one document; `lengths` splits it into several sequences (default: one)."""
        if self._closed:
            self._check_open()
        tokens = self._as_tokens(ids)
        if lengths is None:
            self._sequence_lengths.append(tokens.size)
        else:
            sizes = [int(n) for n in lengths]
            if sum(sizes) != tokens.size or min(sizes, default=0) < 0:
                raise ValueError(
                    f"{self.path_prefix}: sequence lengths {sizes} must be non-negative and "
                    f"sum to the document's {tokens.size} tokens"
                )
            self._sequence_lengths.extend(sizes)
        if tokens is ids or not tokens.flags.owndata:  # the caller's memory: write it now
            self._flush()
            self._bin_file.write(tokens.data if tokens.flags.c_contiguous else tokens.tobytes())
        else:  # a fresh array (converted): batch it with the next ones into one write
            self._pending.append(tokens)
            self._pending_bytes += tokens.nbytes
            if self._pending_bytes >= WRITE_BATCH_BYTES:
                self._flush()
        self._document_indices.append(len(self._sequence_lengths))
        self._num_tokens += tokens.size

    def add_documents(
        self,
        documents: Sequence[Any],
        lengths: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        """Append many documents: the same files as `add_document` on each, in far fewer calls.

        `lengths[i]` splits document i into sequences (None: one sequence). Documents are
        converted, range-checked and written in slices of about `BATCH_TOKENS` tokens. On a
        ValueError (bad shape, ids out of range, lengths that do not add up) nothing of the
        batch is added, so a caller may retry document by document; for that the converted
        batch is held in memory until it is written, so pass batches of bounded size (the
        preprocess sink passes ~128K tokens). The documents are copied: the caller may reuse
        its arrays afterwards.
        """
        self._check_open()
        arrays = as_arrays(documents)
        if lengths is not None and len(lengths) != len(arrays):
            raise ValueError(
                f"{self.path_prefix}: {len(arrays)} documents but {len(lengths)} length lists"
            )
        sizes = document_sizes(arrays, self.path_prefix)
        sequences, boundaries = batch_index(
            sizes, lengths, len(self._sequence_lengths), self.path_prefix
        )
        chunks = []
        for start, stop in slice_bounds(sizes):
            part = arrays[start:stop]
            flat = concat_tokens(part, self.dtype, self.path_prefix)
            if flat is None:  # mixed source dtypes: convert one document at a time
                flat = np.concatenate([self._as_tokens(a) for a in part])
            chunks.append(flat)
        # Everything is validated: only now does the batch become part of the shard.
        self._sequence_lengths.frombytes(sequences.tobytes())
        self._document_indices.frombytes(boundaries.tobytes())
        self._num_tokens += int(sizes.sum())
        for flat in chunks:
            if flat.nbytes >= WRITE_BATCH_BYTES:
                self._flush()
                self._bin_file.write(flat.data)
            elif flat.size:
                self._pending.append(flat)
                self._pending_bytes += flat.nbytes
                if self._pending_bytes >= WRITE_BATCH_BYTES:
                    self._flush()

    def _flush(self) -> None:
        """Write the batched documents (one write call for many small documents)."""
        if self._pending:
            self._bin_file.write(b"".join(a.data for a in self._pending))
            self._pending, self._pending_bytes = [], 0

    def add_index(self, other_prefix: str | os.PathLike[str]) -> None:
        """Append every document of another finished shard with the same dtype (a merge)."""
        self._check_open()
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {os.fspath(other_prefix)!r} (dtype {other.dtype.name}) into "
                f"{self.path_prefix!r} (dtype {self.dtype.name}); re-tokenise with one dtype"
            )
        base = len(self._sequence_lengths)
        self._sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self._document_indices.extend(int(d) + base for d in other.document_indices[1:])
        self._num_tokens += int(other.sequence_lengths.sum(dtype=np.int64))
        self._flush()
        with open(bin_path(other_prefix), "rb") as src:
            while chunk := src.read(1 << 24):
                self._bin_file.write(chunk)

    def _index_bytes(self) -> bytes:
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self._document_indices, dtype=np.int64)
        header = b"".join(
            (
                INDEX_MAGIC,
                struct.pack("<Q", INDEX_VERSION),
                struct.pack("<B", DTYPE_CODES[self.dtype.name]),
                struct.pack("<Q", lengths.size),
                struct.pack("<Q", documents.size),
            )
        )
        return header + lengths.tobytes() + pointers.tobytes() + documents.tobytes()

    def finalize(self) -> tuple[Path, Path]:
        """Write the index and publish both files; returns `(bin_path, idx_path)`."""
        self._check_open()
        self._flush()
        self._closed = True
        self._bin_file.flush()
        os.fsync(self._bin_file.fileno())
        self._bin_file.close()
        with open(self._idx_partial, "wb") as idx_file:
            idx_file.write(self._index_bytes())
            idx_file.flush()
            os.fsync(idx_file.fileno())
        # Drop a stale index first: an old `.idx` next to the new `.bin` would read as valid.
        self._idx_final.unlink(missing_ok=True)
        os.replace(self._bin_partial, self._bin_final)
        os.replace(self._idx_partial, self._idx_final)
        return self._bin_final, self._idx_final

    def abort(self) -> None:
        """Discard the partial files (idempotent; a finished shard is left alone)."""
        if self._closed:
            return
        self._closed = True
        self._pending = []
        self._bin_file.close()
        self._bin_partial.unlink(missing_ok=True)
        self._idx_partial.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.finalize()


def _map(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", order="C")


class IndexedDataset:
    """Read-only mmap view of `{prefix}.bin/.idx`; `ds[i]` is sequence i as a numpy array.

    Reads files from megatron-core's builder and from `IndexedDatasetWriter` alike. Pickles by
    path (DataLoader workers reopen the maps instead of copying them).
    """

    def __init__(self, path_prefix: str | os.PathLike[str]) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self._open()

    def _open(self) -> None:
        index_file, data_file = idx_path(self.path_prefix), bin_path(self.path_prefix)
        for path in (index_file, data_file):
            if not path.is_file():
                raise FileNotFoundError(
                    f"indexed dataset {self.path_prefix!r}: {path} is missing; pass the prefix "
                    "without .bin/.idx (e.g. out/corpus_text_document) of a finished shard"
                )
        index = _map(index_file)
        if index.size < _HEADER_BYTES or bytes(index[: len(INDEX_MAGIC)]) != INDEX_MAGIC:
            raise ValueError(
                f"{index_file} is not a Megatron mmap index (magic {INDEX_MAGIC!r} missing); "
                "re-create it with `meshline preprocess`"
            )
        version, code, count, doc_count = struct.unpack_from("<QBQQ", bytes(index[9:_HEADER_BYTES]))
        if version != INDEX_VERSION:
            raise ValueError(f"{index_file}: index version {version} is unsupported (expected 1)")
        if code not in _CODE_TO_DTYPE:
            raise ValueError(
                f"{index_file}: unknown dtype code {code}; valid: {sorted(_CODE_TO_DTYPE)}"
            )
        self.dtype = _CODE_TO_DTYPE[code]
        expected = _HEADER_BYTES + count * (4 + 8) + doc_count * 8
        if index.size < expected:
            raise ValueError(
                f"{index_file} is truncated: {index.size} bytes, the header promises {expected}"
            )
        offset = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, np.int32, count, offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(index, np.int64, count, offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(index, np.int64, doc_count, offset)
        self._data = _map(data_file)
        end = 0
        if count:
            end = (
                int(self.sequence_pointers[-1])
                + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            )
        if doc_count == 0 or int(self.document_indices[-1]) != count or self._data.size < end:
            raise ValueError(
                f"indexed dataset {self.path_prefix!r} is inconsistent ({count} sequences, last "
                f"document boundary {int(self.document_indices[-1]) if doc_count else None}, "
                f".bin {self._data.size} bytes, needs {end}); re-create the shard"
            )
        self._index = index

    def __getstate__(self) -> dict[str, str]:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        """Number of documents (a document holds one or more sequences)."""
        return int(self.document_indices.size) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (default: to its end), zero-copy."""
        count = len(self)
        if not -count <= idx < count:
            raise IndexError(
                f"sequence {idx} out of range for {self.path_prefix!r} ({count} sequences)"
            )
        idx %= count
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) outside sequence {idx} of length {size} "
                f"in {self.path_prefix!r}"
            )
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._data, self.dtype, length, start)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(
                    f"slices of an indexed dataset must be contiguous, got step {step}"
                )
            return [self.get(i) for i in range(start, stop)]
        return self.get(int(idx))

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (its sequences concatenated)."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(
                f"document {doc} out of range for {self.path_prefix!r} ({self.num_documents} documents)"
            )
        first, last = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if first == last:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.sequence_pointers[first])
        size = int(self.sequence_lengths[first:last].sum(dtype=np.int64))
        return np.frombuffer(self._data, self.dtype, size, start)

    @staticmethod
    def exists(path_prefix: str | os.PathLike[str]) -> bool:
        """Whether both finished files of the shard exist."""
        return idx_path(path_prefix).is_file() and bin_path(path_prefix).is_file()
