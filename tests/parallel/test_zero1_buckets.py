"""ZeRO-1 rebuilds the parameters after its step in bounded all-gather buckets.

One all-gather for the whole model held 1.5 fp32 copies of it per rank at once (send buffer
and gathered tensor), which put ZeRO-1's peak above DDP's in the memory-ladder bench; the
buckets bound that transient. The gathered values are copied, not computed, so any bucket size
gives the same parameters bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from parallel.data_parallel import apply_data_parallel, build_dp_mesh, dp_mesh_1d
from parallel.zero1 import ZeroOneOptimizer, gather_buckets
from tests.harness import run_distributed
from tests.parallel.test_data_parallel_model import (
    build_optimizer,
    build_tiny_model,
    full_parameters,
    train_steps,
)


def test_gather_buckets_bound_each_group_and_keep_the_order():
    assert gather_buckets([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert gather_buckets([3, 20, 2, 2, 5], 8) == [[0], [1], [2, 3], [4]]
    assert gather_buckets([1] * 5, 100) == [[0, 1, 2, 3, 4]]
    assert gather_buckets([], 8) == []


def _train(rank: int, world_size: int, bucket_numel: int) -> dict:
    mesh = build_dp_mesh(world_size, 1, world_size)
    model = apply_data_parallel(build_tiny_model(), mesh, zero_stage=1)
    optimizer = ZeroOneOptimizer(
        build_optimizer(model), model, dp_mesh_1d(mesh), gather_bucket_numel=bucket_numel
    )
    losses = train_steps(model, optimizer, range(4), dp_rank=rank, dp_size=world_size)
    sizes = [world_size * s.rows_per_rank * s.row_numel for s in optimizer.slots]
    return {
        "losses": losses,
        "params": {k: v.numpy() for k, v in full_parameters(model).items()},
        "buckets": len(gather_buckets(sizes, bucket_numel)),
    }


@pytest.mark.dist
def test_small_buckets_give_the_same_parameters_bit_for_bit():
    whole = run_distributed(_train, 2, 1 << 30)
    small = run_distributed(_train, 2, 256)
    assert whole[0]["buckets"] == 1 and small[0]["buckets"] > 5
    for a, b in zip(whole, small, strict=True):
        assert a["losses"] == b["losses"]
        for name, value in a["params"].items():
            assert torch.equal(torch.from_numpy(value), torch.from_numpy(b["params"][name])), name
