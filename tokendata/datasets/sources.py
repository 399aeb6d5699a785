"""Open a `--data-path` prefix as token sources: Megatron `.bin/.idx` or Arrow IPC shards.

Arrow shard sets (written by `tokendata.arrow_shards`) are `{prefix}-00000.arrow`, ...:
one row per document with `input_ids: list<int32>` and `cu_seqlens: list<int32>` (sequence
boundaries inside the row), plus `labels: list<int32>` for instruction data. Pretraining prefixes
look like `{out}_{key}_document`; instruction prefixes are `{out}` (mmap: the three
`{out}_packed_*_document` datasets; Arrow: the `{out}_packed-*.arrow` set).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tokendata.indexed import IndexedDataset

INSTRUCTION_SUFFIXES = ("packed_input_ids", "packed_attention_mask", "packed_labels")


def arrow_files(prefix: str) -> list[Path]:
    """The shard files of an Arrow set, in shard order."""
    return sorted(
        Path(p) for p in glob.glob(f"{glob.escape(prefix)}-[0-9][0-9][0-9][0-9][0-9].arrow")
    )


class ArrowTokenSource:
    """One list column of an Arrow shard set as random-access sequences (memory-mapped)."""

    def __init__(self, files: list[Path], column: str) -> None:
        if not files:
            raise FileNotFoundError("no Arrow shard files given")
        self.files = files
        self.column = column
        values: list[np.ndarray] = []
        seq_lengths: list[np.ndarray] = []
        seq_starts: list[np.ndarray] = []
        doc_counts: list[np.ndarray] = []
        for path in files:
            with pa.memory_map(str(path), "r") as source:
                table = pa.ipc.open_file(source).read_all()
            if column not in table.column_names or "cu_seqlens" not in table.column_names:
                raise ValueError(
                    f"{path} has columns {table.column_names}; expected {column!r} and 'cu_seqlens' "
                    "(written by `meshline preprocess --output-format arrow`)"
                )
            tokens = table.column(column).combine_chunks()
            cu = table.column("cu_seqlens").combine_chunks()
            row_starts = tokens.offsets.to_numpy().astype(np.int64)[:-1]
            cu_values = cu.values.to_numpy().astype(np.int64)
            cu_offsets = cu.offsets.to_numpy().astype(np.int64)
            per_row = np.diff(cu_offsets) - 1
            row_of_seq = np.repeat(np.arange(len(table)), per_row)
            keep = np.ones(cu_values.size, dtype=bool)
            keep[cu_offsets[1:] - 1] = False  # drop each row's closing boundary
            starts_in_row = cu_values[keep]
            lengths = np.diff(cu_values)[keep[:-1]] if cu_values.size else np.zeros(0, np.int64)
            base = sum(v.size for v in values)
            values.append(tokens.values.to_numpy(zero_copy_only=False))
            seq_starts.append(base + row_starts[row_of_seq] + starts_in_row)
            seq_lengths.append(lengths)
            doc_counts.append(per_row)
        self._values = np.concatenate(values) if len(values) > 1 else values[0]
        self.sequence_lengths = np.concatenate(seq_lengths).astype(np.int32)
        self.sequence_pointers = np.concatenate(seq_starts)
        self.document_indices = np.concatenate(([0], np.cumsum(np.concatenate(doc_counts))))
        self.dtype = self._values.dtype

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "column": self.column}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["files"], state["column"])  # type: ignore[misc]

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (default: to its end)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) outside sequence {idx} of length {size}"
            )
        start = int(self.sequence_pointers[idx]) + offset
        return self._values[start : start + length]


def detect_format(prefix: str, instruction: bool) -> str:
    """ "mmap" or "arrow" for a prefix, from the files present."""
    mmap_prefix = f"{prefix}_{INSTRUCTION_SUFFIXES[0]}_document" if instruction else prefix
    if IndexedDataset.exists(mmap_prefix):
        return "mmap"
    if arrow_files(f"{prefix}_packed" if instruction else prefix):
        return "arrow"
    wanted = (
        f"{mmap_prefix}.bin/.idx or {prefix}_packed-00000.arrow"
        if instruction
        else f"{prefix}.bin/.idx or {prefix}-00000.arrow"
    )
    raise FileNotFoundError(
        f"--data-path {prefix!r}: no dataset found (looked for {wanted}); pass the prefix "
        "`meshline preprocess` reported, without suffixes"
    )


@dataclass
class InstructionSources:
    """The aligned token and label sources of one instruction dataset."""

    input_ids: IndexedDataset | ArrowTokenSource
    """Token ids per sample (sequence)."""
    labels: IndexedDataset | ArrowTokenSource
    """Unshifted labels per sample: the input id, or -100 where there is no loss."""


def open_pretraining(prefix: str, data_format: str = "auto") -> IndexedDataset | ArrowTokenSource:
    """The token source behind a pretraining `--data-path` prefix."""
    fmt = detect_format(prefix, False) if data_format == "auto" else data_format
    if fmt == "mmap":
        return IndexedDataset(prefix)
    files = arrow_files(prefix)
    if not files:
        raise FileNotFoundError(f"--data-path {prefix!r}: no {prefix}-00000.arrow shards found")
    return ArrowTokenSource(files, "input_ids")


def open_instruction(prefix: str, data_format: str = "auto") -> InstructionSources:
    """The sources of an instruction `--data-path` prefix (ModelLink's packed_* datasets)."""
    fmt = detect_format(prefix, True) if data_format == "auto" else data_format
    ids: IndexedDataset | ArrowTokenSource
    labels: IndexedDataset | ArrowTokenSource
    if fmt == "mmap":
        ids = IndexedDataset(f"{prefix}_{INSTRUCTION_SUFFIXES[0]}_document")
        labels = IndexedDataset(f"{prefix}_{INSTRUCTION_SUFFIXES[2]}_document")
    else:
        files = arrow_files(f"{prefix}_packed")
        if not files:
            raise FileNotFoundError(
                f"--data-path {prefix!r}: no {prefix}_packed-00000.arrow shards found"
            )
        ids, labels = ArrowTokenSource(files, "input_ids"), ArrowTokenSource(files, "labels")
    if not np.array_equal(ids.sequence_lengths, labels.sequence_lengths):
        raise ValueError(
            f"--data-path {os.fspath(prefix)!r}: input ids and labels disagree on sample lengths; "
            "the packed_* datasets come from different runs, re-run `meshline preprocess`"
        )
    return InstructionSources(ids, labels)
