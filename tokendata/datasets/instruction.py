"""Instruction (fine-tuning) dataset: prompt tokens carry no loss; optional first-fit packing.

Rows are built from samples (the sequences of ModelLink's `packed_*` datasets): one sample per
row, or with `pack` several samples first-fit packed into `seq_length` with position ids
restarting at 0 and segment ids 1, 2, ... per sample. Samples longer than `seq_length` are
truncated. Rows are served in a seeded per-epoch shuffle, as many epochs as `num_samples` needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokendata.datasets.cache import CachedArraysMixin, IndexCache
from tokendata.datasets.packing import first_fit
from tokendata.datasets.samples import IGNORE_INDEX, TokenInfo, make_sample
from tokendata.datasets.sources import InstructionSources


def build_instruction_index(
    lengths: np.ndarray,
    samples: tuple[int, int],
    seq_length: int,
    pack: bool,
    num_samples: int | None,
    seed: int,
) -> dict[str, np.ndarray]:
    """Rows (`row_offsets` into `row_items`, CSR) and the order they are served in (`order`)."""
    begin, end = samples
    if end <= begin:
        raise ValueError(f"the split owns no samples (range [{begin}, {end}))")
    ids = np.arange(begin, end, dtype=np.int64)
    if pack:
        clipped = np.minimum(lengths[begin:end].astype(np.int64), seq_length)
        rows = [[begin + i for i in row] for row in first_fit(clipped, seq_length)]
    else:
        rows = [[int(i)] for i in ids]
    row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=row_offsets[1:])
    row_items = np.fromiter(
        (i for r in rows for i in r), dtype=np.int64, count=int(row_offsets[-1])
    )
    epochs = 1 if num_samples is None else max(1, -(-num_samples // len(rows)))
    rng = np.random.RandomState(seed)
    order = np.concatenate([rng.permutation(len(rows)) for _ in range(epochs)])
    if num_samples is not None:
        order = order[:num_samples]
    return {"row_offsets": row_offsets, "row_items": row_items, "order": order}


def _signed_labels(labels: np.ndarray) -> np.ndarray:
    """Labels as int64; an unsigned shard stored -100 wrapped around (e.g. 65436 in uint16)."""
    out = labels.astype(np.int64)
    if labels.dtype.kind == "u":
        out[out == np.iinfo(labels.dtype).max + 1 + IGNORE_INDEX] = IGNORE_INDEX
    return out


class InstructionDataset(CachedArraysMixin, torch.utils.data.Dataset):
    """Fine-tuning rows with shifted labels (-100 on prompt, padding and each sample's last token)."""

    row_offsets: np.ndarray
    row_items: np.ndarray
    order: np.ndarray

    def __init__(
        self,
        sources: InstructionSources,
        source_id: str,
        split: str,
        sample_range: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
        token_info: TokenInfo,
        pack: bool = False,
        variable_seq_lengths: bool = False,
        cache: IndexCache | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.sources = sources
        self.split = split
        self.seq_length = seq_length
        self.token_info = token_info
        self.pack = pack
        self.variable_seq_lengths = variable_seq_lengths
        lengths = np.asarray(sources.input_ids.sequence_lengths)

        def build() -> dict[str, np.ndarray]:
            try:
                return build_instruction_index(
                    lengths, sample_range, seq_length, pack, num_samples, seed
                )
            except ValueError as error:
                raise ValueError(f"{source_id} ({split} split): {error}") from None

        arrays = build() if cache is None else cache.get_or_build(build, group)
        self.adopt(arrays, cache)
        self.description = None if cache is None else cache.description

    @staticmethod
    def describe(
        source_id: str,
        split: str,
        sample_range: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
        pack: bool,
    ) -> dict[str, Any]:
        """What determines the rows and their order (the cache key)."""
        return {
            "class": "InstructionDataset",
            "index_version": 1,
            "source": source_id,
            "split": split,
            "sample_range": list(sample_range),
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "pack": pack,
        }

    def __len__(self) -> int:
        return int(self.order.shape[0])

    def row(self, idx: int) -> list[int]:
        """Sample ids packed into served row `idx`."""
        if not 0 <= idx < len(self):
            raise IndexError(
                f"sample {idx} out of range for the {self.split} split ({len(self)} rows)"
            )
        row = int(self.order[idx])
        return self.row_items[int(self.row_offsets[row]) : int(self.row_offsets[row + 1])].tolist()

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        inputs, labels, positions, segments = [], [], [], []
        for segment, item in enumerate(self.row(int(idx)), start=1):
            size = min(int(self.sources.input_ids.sequence_lengths[item]), self.seq_length)
            ids = np.asarray(self.sources.input_ids.get(item, 0, size), dtype=np.int64)
            raw = _signed_labels(np.asarray(self.sources.labels.get(item, 0, size)))
            shifted = np.full(size, IGNORE_INDEX, dtype=np.int64)
            shifted[:-1] = raw[1:]  # the next token's label; a sample's last token predicts nothing
            inputs.append(ids)
            labels.append(shifted)
            positions.append(np.arange(size, dtype=np.int64))
            segments.append(np.full(size, segment, dtype=np.int64))
        used = sum(len(x) for x in inputs)
        if not self.variable_seq_lengths and used < self.seq_length:
            pad = self.seq_length - used
            inputs.append(np.full(pad, self.token_info.pad_id, dtype=np.int64))
            labels.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
            positions.append(np.arange(pad, dtype=np.int64))
            segments.append(np.zeros(pad, dtype=np.int64))
        return make_sample(
            np.concatenate(inputs),
            np.concatenate(labels),
            np.concatenate(positions),
            np.concatenate(segments) if self.pack else None,
        )
