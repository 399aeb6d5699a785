"""Deterministic, resumable micro-batch sampling across data-parallel ranks (Megatron's scheme)."""

from __future__ import annotations

from collections.abc import Iterator


class PretrainingSampler:
    """Yields this rank's micro-batches of dataset indices, in order, from `consumed_samples` on.

    Global micro-batch k covers indices `[k * m * d, (k + 1) * m * d)` (m micro-batch size,
    d data-parallel size) counted from `consumed_samples`; rank r takes its contiguous slice
    `[r * m, (r + 1) * m)` of it. Resuming with the consumed-sample count saved in a checkpoint
    therefore continues the exact stream, and the ranks' slices never overlap. The dataset's own
    shuffle index provides the randomness. A last incomplete global micro-batch is dropped unless
    `drop_last=False`, in which case it is split as evenly as possible (ranks may get fewer).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples={total_samples}: the dataset is empty")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} is outside [0, {total_samples}] (the dataset "
                "has fewer samples than the checkpoint consumed; build it with more samples)"
            )
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size {micro_batch_size} must be >= 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    @property
    def global_micro_batch(self) -> int:
        """Samples consumed by one micro-batch step over all data-parallel ranks."""
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.global_micro_batch
        if self.drop_last or remaining % self.global_micro_batch == 0:
            return full
        return full + 1

    def __iter__(self) -> Iterator[list[int]]:
        step = self.global_micro_batch
        start = self.consumed_samples
        while start + step <= self.total_samples:
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += step
        if start < self.total_samples and not self.drop_last:
            tail = list(range(start, self.total_samples))
            share = -(-len(tail) // self.dp_size)
            yield tail[self.dp_rank * share : (self.dp_rank + 1) * share]
