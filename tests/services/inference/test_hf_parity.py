"""Greedy and beam-search outputs token-identical to HF transformers `generate` (fp32, CPU).

Tiny random Llama (GQA, RoPE) and Bloom (ALiBi) models are built in HF and converted through the
adapters. Each case runs HF once without an EOS to pick an EOS id the model really produces
mid-sequence (so the end-of-sequence path is exercised), then compares both with that EOS. HF
is run with every default logits processor disabled, so the settings match exactly.

Every case runs three times: with the engine's defaults (paged KV cache, prefix caching,
chunked prefill under a 2048-token budget), with 2-token blocks and a 5-token step budget, where
the prompt is prefilled in two chunks and, run a second time, found in the prefix cache (two of
its three blocks), and the same with n-gram speculation (greedy rows draft and verify on the
blocks, beams decode plainly; on these 256-token random models drafts are few, 5 over the
greedy cases: tests/engine/test_speculative.py exercises speculation on blocks in depth):
every run must give HF's tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingConfig
from engine.speculative_config import SpeculativeConfig
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import PAD_ID, hf_generate, hf_reference, prompt

PROMPT_LEN = 6


@pytest.fixture(scope="module", params=["llama-gqa", "bloom"])
def models(request):
    hf, ours, config = hf_reference(request.param)
    return hf, ours, config


FEATURES = {
    "defaults": EngineConfig(),
    "chunks+prefix-hits": EngineConfig(block_size=2, max_batch_rows=4, max_num_batched_tokens=5),
    "chunks+prefix-hits+ngram": EngineConfig(
        block_size=2,
        max_batch_rows=4,
        max_num_batched_tokens=5,
        speculative_config=SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=1),
    ),
}


@pytest.fixture(params=list(FEATURES))
def features(request):
    return FEATURES[request.param]


def _generate(ours, config, eos_id, features, ids, cfg):
    """The engine's results for one request, checked equal on a second run (prefix hits)."""
    engine = Engine(ours, TokenizerInfo(config.vocab_size, eos_id=eos_id), features)
    [first] = engine.generate([ids], [cfg])
    [again] = engine.generate([ids], [cfg])
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    if features.block_size == 2:
        assert engine.pool.blocks.stats.hit_tokens == 4
    return first


def _new_tokens(hf_out: torch.Tensor, row: int, length: int, pad_id: int = PAD_ID) -> list[int]:
    """HF's row without the prompt, checked to be padding past `length`."""
    tail = hf_out[row, PROMPT_LEN + length :]
    assert bool((tail == pad_id).all()), f"HF row {row} continues past {length}: {tail.tolist()}"
    return hf_out[row, PROMPT_LEN : PROMPT_LEN + length].tolist()


@pytest.mark.parametrize("seed", [0, 2])
@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_greedy_matches_hf(models, seed, repetition_penalty, features):
    hf, ours, config = models
    ids = prompt(PROMPT_LEN, config.vocab_size, seed=seed)
    free = hf_generate(
        hf, ids, max_new_tokens=16, eos_token_id=None, repetition_penalty=repetition_penalty
    )
    eos = int(free[0, PROMPT_LEN + 8])
    expected = hf_generate(
        hf, ids, max_new_tokens=16, eos_token_id=eos, repetition_penalty=repetition_penalty
    )
    cfg = SamplingConfig(max_new_tokens=16, repetition_penalty=repetition_penalty)
    [result] = _generate(ours, config, eos, features, ids, cfg)
    assert result.token_ids == expected[0, PROMPT_LEN:].tolist()
    assert result.token_ids[-1] == eos and result.finish.value == "stop"


BEAM_CASES = [
    # prompt seed, num_beams, length_penalty, early_stopping, num_return_sequences
    (0, 4, 1.0, False, 1),
    (2, 4, 1.0, True, 4),
    (0, 3, 0.5, False, 3),
    (2, 4, 2.0, True, 2),
    (0, 2, -1.0, False, 2),
]


@pytest.mark.parametrize("seed,beams,length_penalty,early_stopping,n_return", BEAM_CASES)
def test_beam_search_matches_hf(
    models, seed, beams, length_penalty, early_stopping, n_return, features
):
    hf, ours, config = models
    ids = prompt(PROMPT_LEN, config.vocab_size, seed=seed)
    settings = dict(
        max_new_tokens=10,
        num_beams=beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=n_return,
    )
    free = hf_generate(hf, ids, eos_token_id=None, **settings)
    eos = int(free[0, PROMPT_LEN + 3])
    expected = hf_generate(hf, ids, eos_token_id=eos, **settings)
    cfg = SamplingConfig(**settings)
    results = _generate(ours, config, eos, features, ids, cfg)
    assert len(results) == n_return
    for row, result in enumerate(results):
        assert result.token_ids == _new_tokens(expected, row, len(result.token_ids)), row
    # HF stops a whole beam request together: its longest row bounds ours.
    assert max(len(r.token_ids) for r in results) == expected.shape[1] - PROMPT_LEN


def test_beam_search_without_eos_matches_hf(models, features):
    hf, ours, config = models
    ids = prompt(PROMPT_LEN, config.vocab_size, seed=1)
    settings = dict(max_new_tokens=12, num_beams=4, num_return_sequences=4)
    expected = hf_generate(hf, ids, eos_token_id=None, **settings)
    results = _generate(ours, config, None, features, ids, SamplingConfig(**settings))
    assert [r.token_ids for r in results] == expected[:, PROMPT_LEN:].tolist()
    assert all(r.finish.value == "length" for r in results)
