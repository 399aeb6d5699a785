"""`GradSync`: the DDP-style averaging used by ZeRO 0/1 under tensor/pipeline parallelism.

Two gloo ranks with different gradients: every rank ends with the average; a parameter with a
gradient on one rank only gets (its gradient) / 2 on both; one without a gradient anywhere keeps
None; buckets split by dtype and size give the same result as one bucket.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_distributed


def _run(rank: int, bucket_numel: int) -> dict[str, torch.Tensor | None]:
    import torch.distributed as dist

    from parallel.grad_sync import GradSync

    torch.manual_seed(0)
    first, second = nn.Linear(4, 3), nn.Linear(3, 2)
    extra = nn.Parameter(torch.ones(5, dtype=torch.float64))
    unused = nn.Parameter(torch.zeros(2))
    chunk_a = nn.ModuleDict({"lin": first})
    chunk_b = nn.ModuleDict({"lin": second})
    chunk_b.register_parameter("extra", extra)
    chunk_b.register_parameter("unused", unused)
    for p in (*first.parameters(), *second.parameters()):
        p.grad = torch.full_like(p, float(rank + 1))
    if rank == 0:
        extra.grad = torch.full_like(extra, 4.0)
    sync = GradSync([chunk_a, chunk_b], dist.group.WORLD, bucket_numel=bucket_numel)
    sync.start(1)
    sync.finish()
    named = {f"a.{n}": p for n, p in chunk_a.named_parameters()}
    named.update({f"b.{n}": p for n, p in chunk_b.named_parameters()})
    return {n: None if p.grad is None else p.grad.clone() for n, p in named.items()}


def _body(rank: int, world_size: int) -> list[dict[str, torch.Tensor | None]]:
    # One bucket per dtype, and a bucket per parameter (8 elements at most).
    return [_run(rank, bucket_numel) for bucket_numel in (1 << 20, 8)]


@pytest.mark.dist
def test_grad_sync_averages_and_agrees_on_missing_grads():
    results = run_distributed(_body, 2)
    for grads in (g for by_rank in results for g in by_rank):
        for name in ("a.lin.weight", "a.lin.bias", "b.lin.weight", "b.lin.bias"):
            grad = grads[name]
            assert grad is not None
            assert torch.equal(grad, torch.full_like(grad, 1.5)), name
        extra = grads["b.extra"]
        assert extra is not None and extra.dtype == torch.float64
        assert torch.equal(extra, torch.full((5,), 2.0, dtype=torch.float64))
        assert grads["b.unused"] is None
