"""GPTQ's calibration tokens: windows read from a Megatron token shard (`--calibration-data`).

The shard's sequences are taken as one stream of tokens (documents back to back, as pretraining
packs them); `samples` windows of `seq_len` tokens are cut from it at evenly spaced offsets, so
a large shard is sampled across its whole length without reading it all. Every id is checked
against the model's vocabulary before any weight is read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models.config import ModelConfig
from tokendata.indexed import IndexedDataset


def calibration_tokens(
    prefix: Path, samples: int, seq_len: int, config: ModelConfig
) -> torch.Tensor:
    """[samples, seq_len] int64 token ids from the shard at `prefix` (ValueError or
    FileNotFoundError naming --calibration-data / --calibration-* when they cannot be had)."""
    flag = f"--calibration-data {prefix}"
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"--calibration-seq-len {seq_len} exceeds the model's context of "
            f"{config.max_position_embeddings} tokens; use at most that"
        )
    try:
        dataset = IndexedDataset(prefix)
    except (FileNotFoundError, ValueError) as exc:
        raise type(exc)(f"{flag}: {exc}") from exc
    lengths = dataset.sequence_lengths.astype(np.int64)
    total = int(lengths.sum())
    windows = total // seq_len
    if windows < samples:
        raise ValueError(
            f"{flag} holds {total} tokens: {windows} windows of --calibration-seq-len {seq_len}, "
            f"fewer than --calibration-samples {samples}; lower either or give a larger shard"
        )
    ends = np.cumsum(lengths)
    offsets = (np.arange(samples, dtype=np.int64) * windows // samples) * seq_len
    rows = [_read(dataset, ends, int(offset), seq_len) for offset in offsets]
    tokens = torch.from_numpy(np.stack(rows).astype(np.int64))
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= config.vocab_size:
        raise ValueError(
            f"{flag}: token id {high if high >= config.vocab_size else low} is outside the "
            f"model's vocabulary [0, {config.vocab_size}); tokenize the shard with this model's "
            "tokenizer"
        )
    return tokens


def _read(dataset: IndexedDataset, ends: np.ndarray, offset: int, length: int) -> np.ndarray:
    """`length` tokens of the concatenated sequences from stream position `offset`."""
    parts = []
    sequence = int(np.searchsorted(ends, offset, side="right"))
    start = offset - (int(ends[sequence - 1]) if sequence else 0)
    while length > 0:
        available = int(ends[sequence]) - (int(ends[sequence - 1]) if sequence else 0) - start
        take = min(length, available)
        if take > 0:
            parts.append(np.asarray(dataset.get(sequence, start, take)))
        length -= take
        sequence += 1
        start = 0
    return np.concatenate(parts)
