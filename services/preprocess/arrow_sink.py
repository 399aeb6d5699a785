"""The preprocess sink that writes Arrow IPC shards (format: tokendata/arrow_shards.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from services.preprocess.handlers import IGNORE_INDEX, INSTRUCTION_KEYS, PAIRWISE_KEYS
from services.preprocess.outputs import OutputShard


def _list_array(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    values = pa.array(flat.astype(value_type.to_pandas_dtype(), copy=False), type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def _cu_seqlens(lengths: list[int]) -> np.ndarray:
    cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    return cu_seqlens


class _ShardSet:
    """Size-split shards of one dataset."""

    def __init__(
        self,
        stage_prefix: str,
        schema: pa.Schema,
        shard_bytes: int,
        batch_rows: int,
        token_columns: tuple[str, ...] = ("input_ids",),
    ) -> None:
        self.stage_prefix = stage_prefix
        self.schema = schema
        self.token_columns = token_columns
        self.shard_bytes = shard_bytes
        self.batch_rows = batch_rows
        self.files: list[Path] = []
        self.rows: dict[str, list[np.ndarray]] = {name: [] for name in schema.names}
        self.documents = 0
        self.tokens = 0
        self._sink: Any = None
        self._writer: Any = None

    def _open(self) -> None:
        path = Path(f"{self.stage_prefix}-{len(self.files):05d}.arrow")
        self.files.append(path)
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, self.schema)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def add(self, columns: dict[str, np.ndarray]) -> None:
        for name, values in columns.items():
            self.rows[name].append(values)
        self.documents += 1
        self.tokens += sum(int(columns[name].size) for name in self.token_columns)
        if len(self.rows[self.schema.names[0]]) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if not self.rows[self.schema.names[0]]:
            return
        if self._writer is None:
            self._open()
        batch = pa.record_batch(
            [_list_array(self.rows[f.name], f.type.value_type) for f in self.schema],
            schema=self.schema,
        )
        self._writer.write_batch(batch)
        self.rows = {name: [] for name in self.schema.names}
        if self._sink.tell() >= self.shard_bytes:
            self._close()

    def finalize(self) -> list[str]:
        self.flush()
        self._close()
        return [path.name for path in self.files]

    def abort(self) -> None:
        self._close()
        for path in self.files:
            path.unlink(missing_ok=True)


class ArrowSink:
    """Arrow IPC shard sets for pretraining keys or for instruction samples (see module doc)."""

    def __init__(
        self,
        stage_prefix: Path,
        keys: tuple[str, ...],
        metadata: dict[str, Any],
        shard_bytes: int = 256 << 20,
        batch_rows: int = 1024,
    ) -> None:
        self.instruction = keys == INSTRUCTION_KEYS
        self.pairwise = keys == PAIRWISE_KEYS
        ints = pa.list_(pa.int32())
        if self.pairwise:
            self._init_pairwise(stage_prefix, metadata, shard_bytes, batch_rows)
            return
        fields = [pa.field("input_ids", ints), pa.field("cu_seqlens", ints)]
        if self.instruction:
            fields += [pa.field("labels", ints), pa.field("loss_mask", pa.list_(pa.uint8()))]
        schema = pa.schema(fields, metadata={"meshline": json.dumps(metadata)})
        names = {"packed": "packed"} if self.instruction else {f"{k}_document": k for k in keys}
        self._keys = keys
        self._json_keys = names
        self._sets = {
            name: _ShardSet(f"{stage_prefix}_{name}", schema, shard_bytes, batch_rows)
            for name in names
        }

    def _init_pairwise(
        self, stage_prefix: Path, metadata: dict[str, Any], shard_bytes: int, batch_rows: int
    ) -> None:
        """One set of pairs: per side its ids, labels and loss mask (tokendata/arrow_shards.py)."""
        fields = []
        for side in ("chosen", "rejected"):
            fields += [
                pa.field(f"{side}_input_ids", pa.list_(pa.int32())),
                pa.field(f"{side}_labels", pa.list_(pa.int32())),
                pa.field(f"{side}_loss_mask", pa.list_(pa.uint8())),
            ]
        schema = pa.schema(fields, metadata={"meshline": json.dumps(metadata)})
        self._keys = PAIRWISE_KEYS
        self._json_keys = {"pairs": "pairs"}
        tokens = ("chosen_input_ids", "rejected_input_ids")
        self._sets = {
            "pairs": _ShardSet(f"{stage_prefix}_pairs", schema, shard_bytes, batch_rows, tokens)
        }

    def add(self, arrays: dict[str, np.ndarray], lengths: dict[str, list[int]]) -> None:
        """Append one document (row) to each shard set."""
        if self.pairwise:
            row: dict[str, np.ndarray] = {}
            for side in ("chosen", "rejected"):
                labels = arrays[f"{side}_labels"]
                row[f"{side}_input_ids"] = arrays[f"{side}_input_ids"]
                row[f"{side}_labels"] = labels
                row[f"{side}_loss_mask"] = (labels != IGNORE_INDEX).astype(np.uint8)
            self._sets["pairs"].add(row)
            return
        if self.instruction:
            labels = arrays[INSTRUCTION_KEYS[2]]
            self._sets["packed"].add(
                {
                    "input_ids": arrays[INSTRUCTION_KEYS[0]],
                    "cu_seqlens": _cu_seqlens(lengths[INSTRUCTION_KEYS[0]]),
                    "labels": labels,
                    "loss_mask": (labels != IGNORE_INDEX).astype(np.uint8),
                }
            )
            return
        for key in self._keys:
            self._sets[f"{key}_document"].add(
                {"input_ids": arrays[key], "cu_seqlens": _cu_seqlens(lengths[key])}
            )

    def finalize(self) -> list[OutputShard]:
        """Close every shard set."""
        shards = []
        for name, shard_set in self._sets.items():
            files = shard_set.finalize()
            prefix = Path(shard_set.stage_prefix).name
            shards.append(
                OutputShard(
                    self._json_keys[name], prefix, files, shard_set.documents, shard_set.tokens
                )
            )
        return shards

    def abort(self) -> None:
        """Remove every shard written so far."""
        for shard_set in self._sets.values():
            shard_set.abort()
