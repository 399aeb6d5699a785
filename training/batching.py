"""Micro-batches per step, batch-size ramp-up, and the per-rank micro-batch stream.

A step consumes `global_batch` samples: each of the `dp` data-parallel ranks runs
`global_batch / (micro_batch * dp)` micro-batches and accumulates their gradients. With
--rampup-batch-size START INCREMENT SAMPLES the global batch starts at START and grows by
INCREMENT each time SAMPLES / ((GBS - START) / INCREMENT) more samples have been consumed
(Megatron's `RampupBatchsizeNumMicroBatches`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

Sample = dict[str, torch.Tensor]


class MicroBatchCalculator:
    """How many micro-batches the next step runs, given the samples consumed so far."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int,
        rampup: list[int] | None = None,
    ) -> None:
        self.global_batch_size, self.micro_batch_size, self.dp_size = (
            global_batch_size,
            micro_batch_size,
            dp_size,
        )
        per_step = micro_batch_size * dp_size
        if global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                f"{micro_batch_size} x data-parallel size {dp_size}"
            )
        self.rampup = rampup
        if rampup is not None:
            start, increment, samples = rampup
            increments = (global_batch_size - start) // increment
            self._samples_per_increment = samples / increments if increments > 0 else float("inf")

    def global_batch(self, consumed_samples: int) -> int:
        """Global batch size of the step that starts after `consumed_samples` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed_samples >= samples:
            return self.global_batch_size
        steps = int(consumed_samples / self._samples_per_increment)
        return min(start + steps * increment, self.global_batch_size)

    def num_micro_batches(self, consumed_samples: int) -> int:
        """Micro-batches each data-parallel rank runs in that step."""
        return self.global_batch(consumed_samples) // (self.micro_batch_size * self.dp_size)


def pretraining_batches(
    dataset: Any, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> Iterator[list[int]]:
    """Sample indices of this rank's micro-batches, resuming after `consumed_samples` (cycles epochs).

    Global order is 0, 1, 2, ...; each group of `micro_batch_size * dp_size` indices is split
    into contiguous rank slices, as Megatron's `MegatronPretrainingSampler` does, so the same
    samples are seen whatever the data-parallel size.
    """
    total = len(dataset)
    if total == 0:
        raise ValueError("the training dataset is empty; check --data-path and --split")
    position = consumed_samples
    span = micro_batch_size * dp_size
    while True:
        first = position + dp_rank * micro_batch_size
        yield [(first + i) % total for i in range(micro_batch_size)]
        position += span


def stack_samples(samples: list[Sample]) -> Sample:
    """Collate fixed-length samples into `[B, S]` tensors."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class MicroBatchStream:
    """Iterates this rank's micro-batches and counts consumed samples over the whole job."""

    def __init__(
        self,
        dataset: Any,
        *,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        collate: Callable[[list[Sample]], Sample] = stack_samples,
    ) -> None:
        self.dataset, self.collate = dataset, collate
        self.micro_batch_size, self.dp_size = micro_batch_size, dp_size
        self.consumed_samples = consumed_samples
        self._indices = pretraining_batches(
            dataset, consumed_samples, micro_batch_size, dp_rank, dp_size
        )

    def next(self) -> Sample:
        """The next micro-batch; advances consumed samples by micro-batch x dp size."""
        batch = self.collate([self.dataset[i] for i in next(self._indices)])
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return batch
