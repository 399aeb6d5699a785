"""KV cache: prefill + token-by-token decode equals one full forward (fp32, max |Δ| ≤ 1e-5)."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from models.kv_cache import KVCache
from models.registry import get_config

ATOL = 1e-5


def _model(name: str):
    torch.manual_seed(0)
    model = build_model(get_config(name), device="cpu").eval()
    model.init_weights(seed=1)
    return model


def _ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-bloom", "tiny-baichuan-alibi"])
def test_prefill_then_decode_matches_full_forward(name):
    model = _model(name)
    ids = _ids(2, 14)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, batch_size=2, max_seq_len=32)
        steps = [model(ids[:, :6], kv_cache=cache)]
        steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(6, 14)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= ATOL
    assert cache.lengths_B.tolist() == [14, 14]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bloom"])
def test_left_padded_prefill_and_decode(name):
    model = _model(name)
    ids = _ids(3, 12, seed=4)
    real = torch.ones(3, 12, dtype=torch.bool)
    real[1, :4] = False
    real[2, :9] = False
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(ids, key_padding_mask_BS=real, position_ids_BS=positions)
        cache = KVCache.for_model(model, batch_size=3, max_seq_len=16)
        prompt = model(
            ids[:, :10],
            key_padding_mask_BS=real[:, :10],
            position_ids_BS=positions[:, :10],
            kv_cache=cache,
        )
        steps = [prompt]
        for t in (10, 11):
            steps.append(
                model(ids[:, t : t + 1], position_ids_BS=positions[:, t : t + 1], kv_cache=cache)
            )
    got = torch.cat(steps, dim=1)
    assert (got - full)[real].abs().max().item() <= ATOL


def test_rows_of_different_lengths_decode_independently():
    """A row reset mid-way (continuous batching) decodes as if it were alone."""
    model = _model("tiny-llama-gqa")
    a, b = _ids(1, 10, seed=7), _ids(1, 6, seed=8)
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=16)
    with torch.no_grad():
        model(torch.cat([a[:, :4], a[:, :4]]), kv_cache=cache)
        cache.reset_rows([1])
        outs = []
        for t in range(6):
            step = torch.cat([a[:, 4 + t : 5 + t], b[:, t : t + 1]])
            outs.append(model(step, kv_cache=cache))
        alone_a, alone_b = model(a), model(b)
    got = torch.cat(outs, dim=1)
    assert (got[0] - alone_a[0, 4:10]).abs().max().item() <= ATOL
    assert (got[1] - alone_b[0]).abs().max().item() <= ATOL
    assert cache.lengths_B.tolist() == [10, 6]
    with pytest.raises(ValueError, match="different lengths"):
        model(torch.zeros(2, 2, dtype=torch.long), kv_cache=cache)


def test_reorder_and_overflow():
    model = _model("tiny-llama")
    ids = _ids(2, 5)
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=6)
    with torch.no_grad():
        model(ids, kv_cache=cache)
        cache.reorder(torch.tensor([1, 1]))
        nxt = model(ids[1:, :1].repeat(2, 1), kv_cache=cache)
        ref = model(torch.cat([ids[1:], ids[1:, :1]], dim=1))
    assert (nxt - ref[:, -1:]).abs().max().item() <= ATOL
    with pytest.raises(ValueError, match="cache holds 6"):
        model(ids[:, :1], kv_cache=cache)


def test_row_views_write_into_the_pool():
    model = _model("tiny-llama")
    ids = _ids(2, 6, seed=9)
    pool = KVCache.for_model(model, batch_size=3, max_seq_len=8)
    with torch.no_grad():
        model(ids[:1, :4], kv_cache=pool.rows(0, 1))
        model(ids[1:, :2], kv_cache=pool.rows(1, 2))
        assert pool.lengths_B.tolist() == [4, 2, 0]
        both = model(torch.stack([ids[0, 4], ids[1, 2]])[:, None], kv_cache=pool.rows(0, 2))
        expected_a, expected_b = model(ids[:1, :5]), model(ids[1:, :3])
    assert (both[0, 0] - expected_a[0, -1]).abs().max().item() <= ATOL
    assert (both[1, 0] - expected_b[0, -1]).abs().max().item() <= ATOL
    with pytest.raises(ValueError, match=r"rows\(2, 5\)"):
        pool.rows(2, 5)


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-bloom"])
def test_logits_to_keep_returns_the_last_positions(name):
    """logits_to_keep=n equals the last n rows of the full logits, with and without a cache."""
    model = _model(name)
    ids = _ids(2, 7, seed=3)
    with torch.no_grad():
        full = model(ids)
        last_two = model(ids, logits_to_keep=2)
        cache = KVCache.for_model(model, batch_size=2, max_seq_len=8)
        prefill = model(ids[:, :6], kv_cache=cache, logits_to_keep=1)
        step = model(ids[:, 6:], kv_cache=cache, logits_to_keep=1)
    assert last_two.shape == (2, 2, full.shape[-1])
    assert (last_two - full[:, -2:]).abs().max().item() <= ATOL
    assert (prefill[:, 0] - full[:, 5]).abs().max().item() <= ATOL
    assert (step[:, 0] - full[:, 6]).abs().max().item() <= ATOL


@pytest.mark.parametrize("name", ["tiny-llama-gqa", "tiny-bloom"])
def test_compiled_decode_with_a_caller_begun_step(name):
    """A compiled forward given `cache_step` (begun and committed outside the graph) writes the
    cache and attends through meshline::kv_cache_attend like the eager forward: rows of unequal
    length (masked keys), RoPE or ALiBi."""
    torch._dynamo.reset()
    model = _model(name)
    ids = _ids(2, 9, seed=5)
    eager_cache = KVCache.for_model(model, batch_size=2, max_seq_len=12)
    compiled_cache = KVCache.for_model(model, batch_size=2, max_seq_len=12)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for cache in (eager_cache, compiled_cache):
            model(ids[:, :4], kv_cache=cache)
            cache.reset_rows([1])
            model(ids[1:, :2], kv_cache=cache.rows(1, 2))
        for t in range(4, 8):
            step_ids = ids[:, t : t + 1]
            expected = model(step_ids, kv_cache=eager_cache)
            step = compiled_cache.begin(1, None)
            got = compiled(step_ids, kv_cache=compiled_cache, cache_step=step)
            compiled_cache.commit(step)
            assert (got - expected).abs().max().item() <= ATOL
    assert compiled_cache.lengths_B.tolist() == eager_cache.lengths_B.tolist() == [8, 6]
    assert torch.equal(compiled_cache.key_mask_BS, eager_cache.key_mask_BS)
    for key, buf in eager_cache.k_BSKD.items():
        assert (compiled_cache.k_BSKD[key] - buf).abs().max().item() <= ATOL
        assert (compiled_cache.v_BSKD[key] - eager_cache.v_BSKD[key]).abs().max().item() <= ATOL
    with pytest.raises(ValueError, match="cache_step needs the kv_cache"):
        model(ids[:, :1], cache_step=step)
