"""engine.cache_plan: the KV cache's rows follow from the budget and --max-model-len, and what
cannot fit is refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from engine.cache_plan import plan_cache
from engine.config import EngineConfig
from engine.engine import Engine
from engine.slots import SlotPool
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import hf_reference


@pytest.fixture(scope="module")
def model():
    _, ours, config = hf_reference("llama-gqa", seed=1)
    return ours, config


def _engine(model, **fields) -> Engine:
    ours, config = model
    return Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(**fields))


def _dense(model, **fields):
    """The dense-rows plan (tensor/pipeline-parallel engines, sliding windows, CUDA graphs)."""
    ours, config = model
    cfg = EngineConfig(**fields)
    return plan_cache(ours, cfg, config.max_position_embeddings, torch.device("cpu"))


def test_budget_rows_model_len_and_refusals(model):
    _, config = model
    full = _dense(model, max_batch_rows=4)
    assert full.max_model_len == config.max_position_embeddings and full.rows == 4
    per_row = full.bytes_per_row
    cache = SlotPool(model[0], full.rows, full.max_model_len).cache
    allocated = sum(
        b.numel() * b.element_size() for b in (*cache.k_BSKD.values(), *cache.v_BSKD.values())
    )
    assert allocated + cache.key_mask_BS.numel() == 4 * per_row
    assert "4 rows (--max-batch-rows)" in full.summary

    limited = _dense(model, max_batch_rows=32, kv_cache_memory=3 * per_row + 5)
    assert limited.rows == 3 and "as many as the budget holds" in limited.summary
    shorter = _dense(model, max_model_len=32, kv_cache_memory=3 * per_row)
    assert shorter.max_model_len == 32 and shorter.rows == 3 * per_row // (per_row // 4)

    with pytest.raises(ValueError, match=r"holds no row .* lower --max-model-len"):
        _engine(model, kv_cache_memory=per_row - 1)
    with pytest.raises(ValueError, match="--max-model-len 4096 exceeds the model's context"):
        _engine(model, max_model_len=4096)
    with pytest.raises(ValueError, match="--gpu-memory-utilization is a share of an accel"):
        _engine(model, gpu_memory_utilization=0.5)


def test_paged_blocks_follow_the_budget(model):
    _, config = model
    full = _engine(model, max_batch_rows=4)
    plan = full.cache_plan
    per_seq = -(-config.max_position_embeddings // 16)
    assert plan.block_size == 16 and plan.blocks == 4 * per_seq  # capped at 4 full rows
    pool = full.pool
    allocated = sum(
        b.numel() * b.element_size() for b in (*pool.k_blocks.values(), *pool.v_blocks.values())
    )
    per_token = (plan.bytes_per_row - plan.max_model_len) // plan.max_model_len
    assert allocated == plan.blocks * 16 * per_token
    assert "paged, " in plan.summary and "(--max-batch-rows full-length rows)" in plan.summary
    # A budget of 1.5 rows: rows stay --max-batch-rows, blocks follow the budget.
    limited = _engine(model, max_batch_rows=8, kv_cache_memory=plan.bytes_per_row * 3 // 2)
    assert limited.pool.max_rows == 8
    assert limited.cache_plan.blocks == plan.bytes_per_row * 3 // 2 // (16 * per_token)
    assert "as many as the budget holds" in limited.cache_plan.summary


def test_a_request_past_max_model_len_is_refused(model):
    from engine.sampling import SamplingConfig
    from engine.validation import InvalidRequest

    engine = _engine(model, max_model_len=16, max_batch_rows=2)
    with pytest.raises(InvalidRequest, match="--max-model-len"):
        engine.submit(list(range(1, 17)), SamplingConfig(max_new_tokens=1))
    [[result]] = engine.generate([list(range(1, 11))], [SamplingConfig(max_new_tokens=50)])
    assert len(result.token_ids) == 6  # cut at the model length, as before
