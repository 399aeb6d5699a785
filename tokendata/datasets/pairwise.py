"""Preference-pair dataset: what `meshline preprocess` wrote with a pairwise handler, as batches.

Shapes: S sequence. The shards hold per pair `chosen_input_ids` / `chosen_labels` and
`rejected_input_ids` / `rejected_labels` (labels -100 on the prompt): four `.bin/.idx` datasets
`{prefix}_{key}_document` aligned by document, or one Arrow set `{prefix}_pairs-NNNNN.arrow`
(tokendata/arrow_shards.py). Each sample is the pair padded to `seq_length`:
`{side}_input_ids` [S], `{side}_loss_mask` [S] (1 on response tokens) and
`{side}_attention_mask` [S] (1 on real tokens) for side in chosen, rejected
(training/objectives/pairs.py reads them). Pairs are served in a seeded per-epoch shuffle, as
many epochs as `num_samples` needs. A side longer than `seq_length` is an error naming the pair:
cutting it could leave no response, or make both sides equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from tokendata.datasets.samples import IGNORE_INDEX
from tokendata.datasets.sources import arrow_files
from tokendata.indexed import IndexedDataset

PAIR_DATASETS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
"""The shard keys of a pair (the preprocess service's PAIRWISE_KEYS)."""


class PairSource:
    """Random access to the pairs under one output prefix, in either format."""

    def __init__(self, prefix: str, data_format: str = "auto") -> None:
        self.prefix = prefix
        mmap = all(IndexedDataset.exists(f"{prefix}_{key}_document") for key in PAIR_DATASETS)
        files = arrow_files(f"{prefix}_pairs")
        if data_format == "mmap" or (data_format == "auto" and mmap):
            if not mmap:
                raise ValueError(
                    f"--data-path {prefix}: no pairwise .bin/.idx datasets "
                    f"({prefix}_chosen_input_ids_document, ...); preprocess with a pairwise "
                    "--handler-name"
                )
            self._mmap = {key: IndexedDataset(f"{prefix}_{key}_document") for key in PAIR_DATASETS}
            counts = {len(dataset) for dataset in self._mmap.values()}
            if len(counts) != 1:
                raise ValueError(
                    f"--data-path {prefix}: the four pairwise datasets differ in length"
                )
            self._length = counts.pop()
            self._arrow: dict[str, pa.ListArray] | None = None
            return
        if not files:
            raise ValueError(
                f"--data-path {prefix}: no pairwise shards ({prefix}_chosen_input_ids_document.bin/"
                f".idx or {prefix}_pairs-00000.arrow); preprocess with a pairwise --handler-name"
            )
        tables = []
        for path in files:
            with pa.memory_map(str(Path(path)), "r") as source:
                tables.append(pa.ipc.open_file(source).read_all())
        table = pa.concat_tables(tables)
        missing = [key for key in PAIR_DATASETS if key not in table.column_names]
        if missing:
            raise ValueError(f"{files[0]}: not a pairwise Arrow set (no columns {missing})")
        self._arrow = {key: table.column(key).combine_chunks() for key in PAIR_DATASETS}
        self._length = len(table)

    def __len__(self) -> int:
        return self._length

    def pair(self, index: int) -> dict[str, np.ndarray]:
        """The four arrays of pair `index`."""
        if self._arrow is None:
            return {key: np.asarray(self._mmap[key][index]) for key in PAIR_DATASETS}
        out = {}
        for key, column in self._arrow.items():
            start, end = column.offsets[index].as_py(), column.offsets[index + 1].as_py()
            out[key] = column.values.slice(start, end - start).to_numpy()
        return out


class PairwiseDataset(torch.utils.data.Dataset):
    """Pairs `[begin, end)` of a source, padded to `seq_length`, in a seeded shuffled order."""

    def __init__(
        self,
        source: PairSource,
        pairs: tuple[int, int],
        seq_length: int,
        pad_id: int,
        num_samples: int | None,
        seed: int,
    ) -> None:
        begin, end = pairs
        if end <= begin:
            raise ValueError(f"--data-path {source.prefix}: the split owns no pairs")
        self.source = source
        self.seq_length = seq_length
        self.pad_id = pad_id
        count = end - begin
        epochs = 1 if num_samples is None else max(1, -(-num_samples // count))
        rng = np.random.RandomState(seed)
        order = np.concatenate([begin + rng.permutation(count) for _ in range(epochs)])
        self.order = order if num_samples is None else order[:num_samples]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        index = int(self.order[idx])
        arrays = self.source.pair(index)
        sample: dict[str, torch.Tensor] = {}
        for side in ("chosen", "rejected"):
            ids, labels = arrays[f"{side}_input_ids"], arrays[f"{side}_labels"].astype(np.int64)
            n = len(ids)
            if n > self.seq_length or len(labels) != n:
                raise ValueError(
                    f"--data-path {self.source.prefix}: pair {index} has a {side} side of {n} "
                    f"tokens, longer than --seq-length {self.seq_length}; preprocess with "
                    f"--seq-length {self.seq_length} or raise --seq-length"
                )
            padded = torch.full((self.seq_length,), self.pad_id, dtype=torch.long)
            padded[:n] = torch.from_numpy(ids.astype(np.int64))
            loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
            loss_mask[:n] = torch.from_numpy((labels != IGNORE_INDEX).astype(np.float32))
            attention = torch.zeros(self.seq_length, dtype=torch.long)
            attention[:n] = 1
            sample[f"{side}_input_ids"] = padded
            sample[f"{side}_loss_mask"] = loss_mask
            sample[f"{side}_attention_mask"] = attention
        return sample
