"""`--mock-data`: deterministic synthetic token sequences that a model can learn.

Each sample is an arithmetic progression modulo the vocabulary (random start and stride drawn
from the sample index), so the next token follows from the previous two and the loss falls
quickly — useful for smoke tests and benchmarks without a corpus. Samples have the same fields
as the real datasets (input_ids, labels, loss_mask, position_ids).
"""

from __future__ import annotations

import torch

MAX_STRIDE = 7


class MockDataset:
    """`num_samples` samples of `seq_length` tokens below `vocab_size`, fixed by `seed`."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0) -> None:
        if vocab_size < 2 or seq_length < 2 or num_samples < 1:
            raise ValueError(
                "mock data needs vocab_size >= 2, seq_length >= 2 and at least one sample"
            )
        self.num_samples, self.seq_length, self.vocab_size, self.seed = (
            num_samples,
            seq_length,
            vocab_size,
            seed,
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"mock sample {index} out of range [0, {self.num_samples})")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, MAX_STRIDE + 1, (1,), generator=gen))
        tokens = (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {
            "input_ids": tokens[:-1].clone(),
            "labels": tokens[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length),
        }
