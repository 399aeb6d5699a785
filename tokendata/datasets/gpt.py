"""Pretraining dataset: fixed-length samples cut across documents from a shuffled token stream."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokendata.datasets.cache import CachedArraysMixin, IndexCache
from tokendata.datasets.gpt_index import build_gpt_indices
from tokendata.datasets.samples import (
    IGNORE_INDEX,
    TokenInfo,
    TokenSource,
    eod_segments,
    make_sample,
)


class GPTDataset(CachedArraysMixin, torch.utils.data.Dataset):
    """`seq_length`-token samples (plus one label token) over the sequences `[begin, end)`.

    Indices are built once (see `gpt_index`) and cached under `cache_dir`; with `group`, rank 0
    of the group builds and the others load. `len()` may exceed `num_samples`: whole epochs are
    indexed, as in Megatron.
    """

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    def __init__(
        self,
        source: TokenSource,
        source_id: str,
        split: str,
        document_range: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
        token_info: TokenInfo,
        cache: IndexCache | None = None,
        group: dist.ProcessGroup | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
    ) -> None:
        self.source = source
        self.split = split
        self.seq_length = seq_length
        self.token_info = token_info
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        begin, end = document_range
        documents = np.arange(begin, end, dtype=np.int32)

        def build() -> dict[str, np.ndarray]:
            try:
                doc, sample, shuffle = build_gpt_indices(
                    source.sequence_lengths, documents, seq_length, num_samples, seed
                )
            except ValueError as error:
                raise ValueError(
                    f"{source_id} ({split} split, sequences [{begin}, {end})): {error}"
                ) from None
            return {"document_index": doc, "sample_index": sample, "shuffle_index": shuffle}

        arrays = build() if cache is None else cache.get_or_build(build, group)
        self.adopt(arrays, cache)
        self.description = None if cache is None else cache.description

    @staticmethod
    def describe(
        source_id: str,
        split: str,
        document_range: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
    ) -> dict[str, Any]:
        """What determines the indices (the cache key)."""
        return {
            "class": "GPTDataset",
            "index_version": 1,
            "source": source_id,
            "split": split,
            "document_range": list(document_range),
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        }

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def tokens(self, idx: int) -> np.ndarray:
        """The `seq_length + 1` raw tokens of sample `idx` (after shuffling)."""
        if not 0 <= idx < len(self):
            raise IndexError(
                f"sample {idx} out of range for the {self.split} split ({len(self)} samples)"
            )
        row = int(self.shuffle_index[idx])
        first_slot, first_offset = (int(v) for v in self.sample_index[row])
        last_slot, last_offset = (int(v) for v in self.sample_index[row + 1])
        if first_slot == last_slot:
            seq = int(self.document_index[first_slot])
            span = self.source.get(seq, first_offset, last_offset - first_offset + 1)
            return span.astype(np.int64)  # a copy: the mmap view is read-only
        parts = [self.source.get(int(self.document_index[first_slot]), first_offset)]
        for slot in range(first_slot + 1, last_slot):
            parts.append(self.source.get(int(self.document_index[slot])))
        parts.append(self.source.get(int(self.document_index[last_slot]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = self.tokens(int(idx))
        input_ids, labels = text[:-1], text[1:].copy()
        position_ids = segment_ids = None
        if self.reset_position_ids or self.reset_attention_mask:
            positions, segments = eod_segments(input_ids, self.token_info.eod_id)
            position_ids = positions if self.reset_position_ids else None
            segment_ids = segments if self.reset_attention_mask else None
        if self.eod_mask_loss:
            labels[input_ids == self.token_info.eod_id] = IGNORE_INDEX
        return make_sample(input_ids, labels, position_ids, segment_ids)
