"""Stack samples into a micro-batch, padding to a common length (B batch, S sequence)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokendata.datasets.samples import IGNORE_INDEX


def collate(
    samples: Sequence[dict[str, torch.Tensor]],
    variable_seq_lengths: bool = False,
    pad_id: int = 0,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """`[B, S]` tensors from sample dicts.

    With `variable_seq_lengths` S is the longest sample of this micro-batch (rounded up to
    `pad_to_multiple_of`, e.g. the tensor-parallel size under sequence parallelism); otherwise
    every sample must already have the same length. Padding: `input_ids` = `pad_id`, `labels` =
    -100, `loss_mask` = 0, `position_ids` counting on from 0, `segment_ids` = 0.
    """
    if not samples:
        raise ValueError("collate got an empty micro-batch")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1")
    keys = list(samples[0])
    for i, sample in enumerate(samples):
        if list(sample) != keys:
            raise ValueError(f"sample {i} has fields {sorted(sample)}, sample 0 has {sorted(keys)}")
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    longest = max(lengths)
    if not variable_seq_lengths and min(lengths) != longest:
        raise ValueError(
            f"samples have lengths {sorted(set(lengths))} but variable_seq_lengths is off; "
            "enable --variable-seq-lengths or pad samples to seq_length in the dataset"
        )
    target = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "loss_mask": 0, "segment_ids": 0}
    batch: dict[str, torch.Tensor] = {}
    for key in keys:
        rows = []
        for sample, length in zip(samples, lengths, strict=True):
            value = sample[key]
            pad = target - length
            if pad:
                if key == "position_ids":
                    tail = torch.arange(pad, dtype=value.dtype)
                else:
                    tail = torch.full((pad,), fill.get(key, 0), dtype=value.dtype)
                value = torch.cat((value, tail))
            rows.append(value)
        batch[key] = torch.stack(rows)
    return batch
