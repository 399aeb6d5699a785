"""Ring attention equals the kernels' dense causal attention, forward and backward (GQA, ALiBi)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels.attention import alibi_slopes, attention
from parallel.context_parallel import ring_attention, shard_sequence
from tests.harness import run_distributed


def _body(rank: int, world_size: int, alibi: bool) -> list[float]:
    torch.manual_seed(0)
    q = torch.randn(2, 32, 4, 8, requires_grad=True)
    k = torch.randn(2, 32, 2, 8, requires_grad=True)
    v = torch.randn(2, 32, 2, 8, requires_grad=True)
    # Steep slopes (x8): a bias from local instead of global positions would move the output.
    slopes_H = alibi_slopes(4) * 8 if alibi else None
    ref = attention(q, k, v, causal=True, alibi_slopes_H=slopes_H)
    ref.square().sum().backward()
    local = [shard_sequence(t.detach(), rank, world_size).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, dist.group.WORLD, alibi_slopes_H=slopes_H)
    out.square().sum().backward()
    diffs = [float((out - shard_sequence(ref.detach(), rank, world_size)).abs().max())]
    for mine, full in zip(local, (q, k, v), strict=True):
        diffs.append(float((mine.grad - shard_sequence(full.grad, rank, world_size)).abs().max()))
    return diffs


@pytest.mark.dist
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_dense(cp, alibi):
    # fp32: the lse merge and blockwise order differ from one dense softmax by rounding only.
    for diffs in run_distributed(_body, cp, alibi):
        assert max(diffs) < 1e-5, diffs
