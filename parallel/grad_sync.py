"""DDP-style gradient averaging for model-parallel replicas (ZeRO 0/1 under TP and/or PP).

`torch`'s DDP (`replicate`) wants plain-tensor parameters and hooks a module's own backward; a
tensor-parallel replica holds DTensor parameters and a pipeline rank runs its backward inside a
`torch.distributed.pipelining` schedule. So, as Megatron's DDP does, gradients here accumulate
locally over a step's micro-batches and are all-reduced over the data x context-parallel group
once, in flat buckets: on DTensor parameters the local shard is reduced (the data-parallel group
is orthogonal to the tensor-parallel mesh, so local shards line up rank by rank).

`start(chunk)` launches one chunk's buckets asynchronously — under pipeline parallelism that is
called as soon as the chunk's last micro-batch backward finished, so the reduction overlaps
the rest of the schedule (`--overlap-grad-reduce`) — and `finish()` launches what is left, waits,
and writes the averaged gradients back. A parameter without a gradient on every rank stays
without one; with a gradient on some ranks it gets the average over all (zeros elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Elements per all-reduce bucket (fp32: 64 MiB), Megatron's order of magnitude.
BUCKET_NUMEL = 1 << 24


@dataclass
class _Bucket:
    """Parameters of one dtype reduced together, and the in-flight buffer."""

    params: list[nn.Parameter]
    numel: int
    sizes: list[int] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    work: dist.Work | None = field(default=None, repr=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GradSync:
    """All-reduce-average the gradients of `chunks`' parameters over `group` (see module doc)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        group: dist.ProcessGroup,
        *,
        bucket_numel: int = BUCKET_NUMEL,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        seen: set[int] = set()  # a parameter shared by two chunks is reduced once
        self.buckets = [self._bucketize(c, bucket_numel, seen) for c in chunks]
        self._started = [False] * len(self.buckets)

    @staticmethod
    def _bucketize(chunk: nn.Module, bucket_numel: int, seen: set[int]) -> list[_Bucket]:
        by_dtype: dict[torch.dtype, list[_Bucket]] = {}
        # Reverse order: the last layers' gradients are ready first in backward.
        params = [p for p in chunk.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        for param in reversed(params):
            numel = _local(param).numel()
            buckets = by_dtype.setdefault(param.dtype, [])
            if not buckets or (buckets[-1].numel + numel > bucket_numel and buckets[-1].params):
                buckets.append(_Bucket([], 0))
            buckets[-1].params.append(param)
            buckets[-1].numel += numel
        return [b for buckets in by_dtype.values() for b in buckets]

    def start(self, chunk: int) -> None:
        """Launch the all-reduce of chunk `chunk`'s gradients (no-op if already launched)."""
        if self._started[chunk]:
            return
        self._started[chunk] = True
        for bucket in self.buckets[chunk]:
            # Gradients, then one presence flag per parameter (so ranks agree on None grads).
            # A gradient's local shape may differ from its parameter's (a Shard(0) embedding
            # gets a Replicate gradient): the layout follows the gradients.
            parts = [
                _local(p.grad).reshape(-1)
                if p.grad is not None
                else _local(p).new_zeros(_local(p).numel())
                for p in bucket.params
            ]
            bucket.sizes = [part.numel() for part in parts]
            flags = [1.0 if p.grad is not None else 0.0 for p in bucket.params]
            parts.append(torch.tensor(flags, dtype=bucket.params[0].dtype))
            bucket.buffer = torch.cat(parts)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what is not yet, wait for every bucket, write averaged gradients back."""
        for chunk in range(len(self.buckets)):
            self.start(chunk)
        for buckets in self.buckets:
            for bucket in buckets:
                assert bucket.work is not None and bucket.buffer is not None
                bucket.work.wait()
                self._write_back(bucket, bucket.buffer.div_(self.size))
                bucket.buffer, bucket.work = None, None
        self._started = [False] * len(self.buckets)

    @staticmethod
    def _write_back(bucket: _Bucket, reduced: torch.Tensor) -> None:
        flags = reduced[sum(bucket.sizes) :]
        offset = 0
        for index, (p, size) in enumerate(zip(bucket.params, bucket.sizes, strict=True)):
            value = reduced[offset : offset + size]
            offset += size
            if p.grad is not None:
                _local(p.grad).copy_(value.view_as(_local(p.grad)))
            elif float(flags[index]) > 0:
                grad = value.view_as(_local(p)).clone()
                if isinstance(p, DTensor):
                    p.grad = DTensor.from_local(
                        grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                else:
                    p.grad = grad
