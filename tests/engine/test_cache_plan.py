"""engine.cache_plan: the KV cache's rows follow from the budget and --max-model-len, and what
cannot fit is refused naming the flag."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import hf_reference


@pytest.fixture(scope="module")
def model():
    _, ours, config = hf_reference("llama-gqa", seed=1)
    return ours, config


def _engine(model, **fields) -> Engine:
    ours, config = model
    return Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(**fields))


def test_budget_rows_model_len_and_refusals(model):
    _, config = model
    full = _engine(model, max_batch_rows=4)
    assert full.max_seq_len == config.max_position_embeddings and full.pool.max_rows == 4
    per_row = full.cache_plan.bytes_per_row
    cache = full.pool.cache
    allocated = sum(
        b.numel() * b.element_size() for b in (*cache.k_BSKD.values(), *cache.v_BSKD.values())
    )
    assert allocated + cache.key_mask_BS.numel() == 4 * per_row
    assert "4 rows (--max-batch-rows)" in full.cache_plan.summary

    limited = _engine(model, max_batch_rows=32, kv_cache_memory=3 * per_row + 5)
    assert (
        limited.pool.max_rows == 3 and "as many as the budget holds" in limited.cache_plan.summary
    )
    shorter = _engine(model, max_model_len=32, kv_cache_memory=3 * per_row)
    assert shorter.max_seq_len == 32 and shorter.pool.max_rows == 3 * per_row // (per_row // 4)

    with pytest.raises(ValueError, match=r"holds no row .* lower --max-model-len"):
        _engine(model, kv_cache_memory=per_row - 1)
    with pytest.raises(ValueError, match="--max-model-len 4096 exceeds the model's context"):
        _engine(model, max_model_len=4096)
    with pytest.raises(ValueError, match="--gpu-memory-utilization is a share of an accel"):
        _engine(model, gpu_memory_utilization=0.5)


def test_a_request_past_max_model_len_is_refused(model):
    from engine.sampling import SamplingConfig
    from engine.validation import InvalidRequest

    engine = _engine(model, max_model_len=16, max_batch_rows=2)
    with pytest.raises(InvalidRequest, match="--max-model-len"):
        engine.submit(list(range(1, 17)), SamplingConfig(max_new_tokens=1))
    [[result]] = engine.generate([list(range(1, 11))], [SamplingConfig(max_new_tokens=50)])
    assert len(result.token_ids) == 6  # cut at the model length, as before
