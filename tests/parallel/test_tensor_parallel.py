"""TP/SP gradients equal the unsharded model's: fused and unfused projections, KV heads split
(TP ≤ KV heads) and replicated (TP > KV heads), loss-parallel cross entropy."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.harness import run_distributed

CASES = {
    "fused": {},
    "unfused": {"fused_qkv": False, "fused_gate_up": False},
}


def _all_cases(rank: int, world_size: int, sp: bool) -> dict[str, dict[str, float]]:
    return {case: _grads_match(world_size, overrides, sp) for case, overrides in CASES.items()}


def _grads_match(world_size: int, overrides: dict, sp: bool) -> dict[str, float]:
    from models.registry import get_config
    from models.transformer import build_model
    from parallel.parallel_dims import ParallelDims
    from parallel.tensor_parallel import (
        apply_tensor_parallel,
        loss_parallel,
        tp_cross_entropy_sum,
    )

    config = get_config("tiny-llama-gqa", **overrides)
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (2, 2, 16), generator=gen)
    mask, pos = torch.ones(2, 16), torch.arange(16).expand(2, 16)
    ref = build_model(config, "cpu")
    ref.init_weights(seed=1)
    ref_loss = tp_cross_entropy_sum(ref(ids, position_ids_BS=pos), labels, mask)
    ref_loss.backward()
    model = build_model(config, "cpu")
    model.init_weights(seed=1)
    dims = ParallelDims(world_size, tp=world_size, sequence_parallel=sp)
    apply_tensor_parallel(model, dims.submesh("tp"), config, sequence_parallel=sp)
    with loss_parallel():
        loss = tp_cross_entropy_sum(model(ids, position_ids_BS=pos), labels, mask)
        loss.backward()
    out = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))}
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        grad = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        out[name] = float((p.grad - grad).abs().max() / p.grad.abs().max())
    return out


@pytest.mark.dist
@pytest.mark.parametrize(("tp", "sp"), [(2, True), (4, False)], ids=["tp2-sp", "tp4-kv-replicated"])
def test_tp_gradients_equal_unsharded(tp, sp):
    for by_case in run_distributed(_all_cases, tp, sp):
        for case, result in by_case.items():
            worst = max(result, key=result.get)
            # fp32, different summation order only: relative to the largest gradient entry.
            assert result[worst] < 1e-5, (case, worst, result[worst])
