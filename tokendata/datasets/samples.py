"""The sample contract every dataset here returns, and the token facts it needs.

A sample is a dict of 1-D tensors of one length S:
`input_ids` int64, `labels` int64 (already shifted: `labels[i]` is the target for
`input_ids[i]`; -100 = no loss), `loss_mask` float32 (1 where `labels != -100`), `position_ids`
int64, and `segment_ids` int64 when documents share a row (1, 2, ... per document, 0 = padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

IGNORE_INDEX = -100


class TokenSource(Protocol):
    """Random access to tokenised sequences (`IndexedDataset`, `ArrowTokenSource`)."""

    sequence_lengths: np.ndarray

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx`."""
        ...


@dataclass(frozen=True)
class TokenInfo:
    """The special ids datasets need from the tokenizer."""

    eod_id: int
    """End-of-document id (EOD masks / position resets)."""
    pad_id: int
    """Id written into padded input positions (never trained on)."""

    @classmethod
    def from_any(cls, info: Any) -> TokenInfo:
        """From a tokenizer (`.eod_id`, `.pad_id`), a mapping (its `describe()`), or a TokenInfo."""
        if isinstance(info, TokenInfo):
            return info
        if isinstance(info, Mapping):
            get = info.get
        else:

            def get(key: str, default: Any = None) -> Any:
                return getattr(info, key, default)

        eod, pad = get("eod_id"), get("pad_id")
        if eod is None:
            raise ValueError(
                f"tokenizer info {info!r} has no eod_id; pass the tokenizer from "
                "models.tokenizer.build_tokenizer or its describe() dict"
            )
        return cls(eod_id=int(eod), pad_id=int(eod if pad is None else pad))


def make_sample(
    input_ids: np.ndarray,
    labels: np.ndarray,
    position_ids: np.ndarray | None = None,
    segment_ids: np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of the sample contract from numpy rows (loss mask derived from the labels)."""
    labels_t = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    sample = {
        "input_ids": torch.as_tensor(np.asarray(input_ids, dtype=np.int64)),
        "labels": labels_t,
        "loss_mask": (labels_t != IGNORE_INDEX).to(torch.float32),
        "position_ids": torch.as_tensor(
            np.arange(len(input_ids), dtype=np.int64)
            if position_ids is None
            else np.asarray(position_ids, dtype=np.int64)
        ),
    }
    if segment_ids is not None:
        sample["segment_ids"] = torch.as_tensor(np.asarray(segment_ids, dtype=np.int64))
    return sample


def eod_segments(input_ids: np.ndarray, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(position ids restarting after each EOD, segment ids 1, 2, ... that change after each EOD)."""
    is_eod = np.asarray(input_ids) == eod_id
    segment = np.ones(len(input_ids), dtype=np.int64)
    segment[1:] += np.cumsum(is_eod[:-1])
    starts = np.flatnonzero(np.diff(segment, prepend=0))
    positions = np.arange(len(input_ids), dtype=np.int64)
    positions -= np.repeat(starts, np.diff(np.append(starts, len(input_ids))))
    return positions, segment
