"""Sliding-window KV cache rings (`models/kv_ring.py`): a Mistral-style model's cache holds W
slots per row (W = window = 8 for tiny-mistral) however long the sequence, and still gives the
full forward's logits (fp32, 1e-5) and transformers' `generate` tokens past the window: chunked
prefills that wrap the ring, left padding, rows of unequal length, beam reordering, the compiled
decode op and the engine's slot pool."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingConfig
from engine.slots import SlotPool
from engine.tokens import TokenizerInfo
from models import build_model
from models.hf_adapters import from_hf
from models.kv_cache import KVCache
from models.registry import get_config
from tests.models.test_families import hf_model
from tests.services.inference.helpers import hf_generate, prompt

ATOL = 1e-5
WINDOW = 8


def _mistral():
    torch.manual_seed(0)
    model = build_model(get_config("tiny-mistral"), device="cpu").eval()
    model.init_weights(seed=1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(6.0)  # std 0.12: attention far from uniform, so old keys would matter
    return model


def _ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def test_the_cache_holds_the_window_not_the_sequence():
    model = _mistral()
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=128)
    assert cache.is_ring and cache.slots == WINDOW
    for buf in (*cache.k_BSKD.values(), *cache.v_BSKD.values()):
        assert tuple(buf.shape) == (2, WINDOW, 2, 16)
    assert tuple(cache.key_mask_BS.shape) == (2, WINDOW)
    pool = SlotPool(model, 4, 128)
    assert pool.cache.slots == WINDOW and pool.cache.max_seq_len == 128
    # No window, or a window longer than the cache: every position has its slot.
    plain = build_model(get_config("tiny-llama"), device="meta")
    assert KVCache(plain.layers.keys(), 1, 128, 4, 16).slots == 128
    assert not KVCache(plain.layers.keys(), 1, 6, 4, 16, window=WINDOW).is_ring
    with pytest.raises(ValueError, match="window=0"):
        KVCache(plain.layers.keys(), 1, 6, 4, 16, window=0)


def test_chunks_and_decode_past_the_window_equal_the_full_forward():
    """Chunks that stay inside the ring, that wrap it from a partly filled ring, that are longer
    than the ring, then one token at a time: 40 positions through 8 slots."""
    model = _mistral()
    ids = _ids(2, 40)
    bounds = [0, 5, 11, 12, 25, *range(26, 41)]
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, batch_size=2, max_seq_len=64)
        steps = [model(ids[:, a:b], kv_cache=cache) for a, b in itertools.pairwise(bounds)]
        no_window = build_model(get_config("tiny-mistral", sliding_window=None), device="cpu")
        no_window.load_state_dict(model.state_dict())
        assert (no_window.eval()(ids) - full)[:, WINDOW:].abs().max().item() > 1e-2
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= ATOL
    assert cache.lengths_B.tolist() == [40, 40]
    with pytest.raises(ValueError, match="would need 65 slots"):
        model(_ids(2, 25), kv_cache=cache)
    assert cache.lengths_B.tolist() == [40, 40]  # a refused step leaves the cache unchanged


def test_left_padded_prompt_longer_than_the_window():
    model = _mistral()
    ids = _ids(3, 30, seed=4)
    real = torch.ones(3, 30, dtype=torch.bool)
    real[1, :4] = False
    real[2, :15] = False
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(ids, key_padding_mask_BS=real, position_ids_BS=positions)
        cache = KVCache.for_model(model, batch_size=3, max_seq_len=32)
        steps = [
            model(
                ids[:, :20],
                key_padding_mask_BS=real[:, :20],
                position_ids_BS=positions[:, :20],
                kv_cache=cache,
            )
        ]
        for t in range(20, 30):
            steps.append(
                model(ids[:, t : t + 1], position_ids_BS=positions[:, t : t + 1], kv_cache=cache)
            )
    got = torch.cat(steps, dim=1)
    assert (got - full)[real].abs().max().item() <= ATOL


def test_reorder_keeps_ring_rows():
    """Beam search's reorder on a wrapped ring: each row continues as the row it copied."""
    model = _mistral()
    ids = _ids(3, 20, seed=2)
    with torch.no_grad():
        cache = KVCache.for_model(model, batch_size=3, max_seq_len=32)
        model(ids[:, :14], kv_cache=cache)
        cache.reorder(torch.tensor([2, 2, 0]))
        step = model(ids[[2, 2, 0], 14:20], kv_cache=cache)
        full = model(ids[[2, 2, 0]])
    assert (step - full[:, 14:20]).abs().max().item() <= ATOL


def test_compiled_decode_over_rings_of_unequal_rows():
    """The compiled one-token forward (meshline::kv_cache_attend) on a ring: rows of unequal
    length, both wrapping the ring, equal their own full forwards."""
    torch._dynamo.reset()
    model = _mistral()
    ids = _ids(2, 26, seed=5)
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=32)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        model(ids[:, :10], kv_cache=cache)
        cache.reset_rows([1])
        model(ids[1:, :3], kv_cache=cache.rows(1, 2))
        fulls = [model(ids[:1]), model(ids[1:, :19])]
        for t in range(16):
            step_ids = torch.stack([ids[0, 10 + t], ids[1, 3 + t]])[:, None]
            step = cache.begin(1, None)
            got = compiled(step_ids, kv_cache=cache, cache_step=step)
            cache.commit(step)
            assert (got[0, 0] - fulls[0][0, 10 + t]).abs().max().item() <= ATOL, t
            assert (got[1, 0] - fulls[1][0, 3 + t]).abs().max().item() <= ATOL, t
    assert cache.lengths_B.tolist() == [26, 19]


def test_engine_greedy_and_beam_past_the_window_equal_hf_generate():
    """The engine's slot pool is rings of the window; prompts shorter and longer than the window,
    decoded together (continuous batching, rows of unequal length) for 30 tokens past it, give
    HF `generate`'s tokens, as does 3-beam search."""
    config = get_config("tiny-mistral")
    hf = hf_model("tiny-mistral", seed=11)
    ours = build_model(config, device="cpu").eval()
    ours.load_state_dict(from_hf(hf.state_dict(), config))
    engine = Engine(ours, TokenizerInfo(config.vocab_size, eos_id=None), EngineConfig())
    assert engine.pool.cache.slots == WINDOW < engine.max_seq_len
    prompts = [prompt(n, config.vocab_size, seed=n) for n in (3, 7, 20)]
    results = engine.generate(prompts, [SamplingConfig(max_new_tokens=30)] * 3)
    for ids, [greedy] in zip(prompts, results, strict=True):
        expected = hf_generate(hf, ids, max_new_tokens=30, eos_token_id=None)
        assert greedy.token_ids == expected[0, len(ids) :].tolist(), len(ids)
    ids = prompts[2]
    beams = SamplingConfig(max_new_tokens=12, num_beams=3, num_return_sequences=3)
    [got] = engine.generate([ids], [beams])
    expected = hf_generate(
        hf, ids, max_new_tokens=12, num_beams=3, num_return_sequences=3, eos_token_id=None
    )
    assert [g.token_ids for g in got] == [row[len(ids) :].tolist() for row in expected]


def test_engine_score_of_choices_sharing_a_context_past_the_window():
    """Scoring runs a shared context once into a ring (a prefill longer than the window), copies
    the row, then one right-padded multi-token forward of the continuations over the rings: the
    per-token log-probabilities equal HF's log-softmax."""
    config = get_config("tiny-mistral")
    hf = hf_model("tiny-mistral", seed=12)
    ours = build_model(config, device="cpu").eval()
    ours.load_state_dict(from_hf(hf.state_dict(), config))
    engine = Engine(ours, TokenizerInfo(config.vocab_size, eos_id=None), EngineConfig())
    context = prompt(19, config.vocab_size, seed=40)
    choices = [prompt(n, config.vocab_size, seed=41 + n) for n in (11, 4, 1)]
    results = engine.score([(context, c) for c in choices])
    for cont, result in zip(choices, results, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([context + cont])).logits[0], -1)
        rows = logp[len(context) - 1 : len(context) - 1 + len(cont)]
        expected = rows.gather(1, torch.tensor(cont)[:, None])[:, 0]
        assert result.token_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
