"""Serving and training apply one TP plan: on every rank, each weight the serving layout keeps
is exactly the training shard's (plain Shard(0)/Shard(1) local tensors, or for packed and
sliced styles the rows the training forward gathers), and both give the one-process logits.

Covers a fused [q; k; v] with GQA and a fused [gate; up] (tiny-llama-gqa), unfused projections,
and ALiBi head offsets, biases and a tied vocabulary-parallel head (tiny-bloom, which trains
with sequence parallelism: its embedding layernorm needs it)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.harness import run_distributed

CASES = {
    "llama-gqa-fused": ("tiny-llama-gqa", {}),
    "llama-gqa-unfused": ("tiny-llama-gqa", {"fused_qkv": False, "fused_gate_up": False}),
    "bloom": ("tiny-bloom", {}),
}


def _compare(rank: int, world_size: int, family: str, overrides: dict) -> dict[str, object]:
    from models.registry import get_config
    from models.transformer import build_model
    from parallel.parallel_dims import ParallelDims
    from parallel.tensor_parallel import apply_tensor_parallel
    from parallel.tp_styles import row_selectors

    config = get_config(family, **overrides)
    reference = build_model(config, "cpu").eval()
    reference.init_weights(seed=1)
    trained, served = copy.deepcopy(reference), copy.deepcopy(reference)
    sp = config.embedding_layernorm
    mesh = ParallelDims(world_size, tp=world_size, sequence_parallel=sp).submesh("tp")
    train_plan = apply_tensor_parallel(trained, mesh, config, sequence_parallel=sp)
    serve_plan = apply_tensor_parallel(served, mesh, config, mode="serve")
    rows = row_selectors(config)
    checked: dict[str, object] = {}
    for name, style in serve_plan.items():
        train_module, serve_module = trained.get_submodule(name), served.get_submodule(name)
        if style == "alibi_heads":
            checked[name] = train_module.head_offset == serve_module.head_offset == rank * 2
            continue
        assert train_plan[name].startswith(style), (name, style, train_plan[name])
        for leaf, kept in serve_module.named_parameters(recurse=False):
            shard = getattr(train_module, leaf)
            assert isinstance(shard, DTensor), (name, leaf)
            if style in rows:
                want = shard.full_tensor().index_select(0, rows[style](rank, world_size))
            else:
                want = shard.to_local()
            checked[f"{name}.{leaf}"] = torch.equal(kept, want)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=gen)
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        want_logits = reference(ids, position_ids_BS=pos)
        train_logits = trained(ids, position_ids_BS=pos).full_tensor()
        serve_logits = served(ids, position_ids_BS=pos)
    for what, got in (("train", train_logits), ("serve", serve_logits)):
        checked[f"logits ({what})"] = float((got - want_logits).abs().max())
    return checked


def _all(rank: int, world_size: int) -> dict[str, dict[str, object]]:
    return {case: _compare(rank, world_size, *spec) for case, spec in CASES.items()}


@pytest.mark.dist
def test_serving_shard_equals_training_shard():
    for by_case in run_distributed(_all, 2):
        for case, checked in by_case.items():
            weights = {k: v for k, v in checked.items() if not k.startswith("logits")}
            assert any(
                k.endswith("qkv_proj.weight") or k.endswith("q_proj.weight") for k in weights
            )
            assert all(v is True for v in weights.values()), (case, weights)
            for key in ("logits (train)", "logits (serve)"):
                # fp32, a different summation order only (row-parallel partial sums).
                assert checked[key] < 1e-5, (case, key, checked[key])
