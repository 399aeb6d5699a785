"""Scoring: choices that share a context run it once over a KV cache, with the same results as
scoring every (context, continuation) pair in its own padded row, and as HF's log-softmax."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.scoring import score_batch
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import hf_reference, prompt


def _items(vocab: int) -> list[tuple[list[int], list[int]]]:
    question = prompt(11, vocab, seed=1)
    other = prompt(6, vocab, seed=2)
    return [
        (question, prompt(3, vocab, seed=3)),
        (prompt(4, vocab, seed=4), prompt(2, vocab, seed=5)),  # a context of its own
        (question, prompt(1, vocab, seed=6)),
        (other, prompt(5, vocab, seed=7)),
        (question, prompt(4, vocab, seed=8)),
        (other, prompt(1, vocab, seed=9)),
        (question, prompt(3, vocab, seed=3)),  # a repeated item
    ]


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
@pytest.mark.parametrize("budget", [8192, 30])
def test_shared_contexts_score_like_separate_rows_and_hf(name, budget):
    hf, ours, config = hf_reference(name, seed=3)
    engine = Engine(ours, TokenizerInfo(config.vocab_size))
    items = _items(config.vocab_size)
    forwards: list[tuple[int, ...]] = []

    def counted(ids_BS, mask_BS, kv_cache):
        forwards.append(tuple(ids_BS.shape))
        return engine._full_logits(ids_BS, mask_BS, kv_cache)

    kwargs = dict(device=engine.device, pad_id=0, max_batch_tokens=budget)
    shared = score_batch(counted, items, new_cache=engine._scoring_cache, **kwargs)
    separate = score_batch(engine._full_logits, items, **kwargs)
    assert len(shared) == len(separate) == len(items)
    for a, b in zip(shared, separate, strict=True):
        torch.testing.assert_close(a.token_logprobs, b.token_logprobs, atol=1e-4, rtol=1e-5)
        assert a.is_greedy == b.is_greedy
    if budget == 8192:
        # The four choices of `question` ran its 11 tokens once, not four times; the padded
        # path ran only the item with a context of its own.
        assert forwards.count((1, 11)) == 1
        assert sum(1 for shape in forwards if shape[1] > 11) == 0
    with torch.no_grad():
        for (context, continuation), result in zip(items, shared, strict=True):
            full = torch.tensor([context + continuation])
            logprobs = torch.log_softmax(hf(full).logits[0].float(), -1)
            rows = logprobs[len(context) - 1 : len(context) - 1 + len(continuation)]
            expected = rows.gather(1, torch.tensor(continuation)[:, None])[:, 0].tolist()
            torch.testing.assert_close(result.token_logprobs, expected, atol=1e-4, rtol=1e-5)


def test_engine_score_uses_the_shared_path():
    _, ours, config = hf_reference("llama-gqa", seed=3)
    engine = Engine(ours, TokenizerInfo(config.vocab_size))
    items = _items(config.vocab_size)
    separate = score_batch(engine._full_logits, items, device=engine.device)
    for a, b in zip(engine.score(items), separate, strict=True):
        torch.testing.assert_close(a.logprob, b.logprob, atol=1e-4, rtol=1e-5)


def test_repeated_items_are_scored_once():
    _, ours, config = hf_reference("llama-gqa", seed=3)
    engine = Engine(ours, TokenizerInfo(config.vocab_size))
    vocab = config.vocab_size
    a = (prompt(9, vocab, seed=1), prompt(3, vocab, seed=2))
    b = (prompt(7, vocab, seed=3), prompt(2, vocab, seed=4))
    forwards: list[tuple[int, ...]] = []

    def counted(ids_BS, mask_BS, kv_cache):
        forwards.append(tuple(ids_BS.shape))
        return engine._full_logits(ids_BS, mask_BS, kv_cache)

    results = score_batch(
        counted, [a, b, a, a], device=engine.device, new_cache=engine._scoring_cache
    )
    # a's copies neither share a context with each other (no cache, no extra rows) nor rerun.
    assert forwards == [(2, 12)]
    once = score_batch(engine._full_logits, [a, b], device=engine.device)
    for result, expected in zip(results, [once[0], once[1], once[0], once[0]], strict=True):
        assert result == expected
    assert (
        results[2] is not results[0] and results[2].token_logprobs is not results[0].token_logprobs
    )
