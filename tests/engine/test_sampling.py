"""Sampling: the filters equal HF's logits warpers, nothing outside top-k / the top-p nucleus is
ever drawn (checked on the masks and on real generations), and seeds reproduce outputs."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.engine import Engine
from engine.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    apply_temperature,
    sample_rows,
    top_k_filter,
    top_p_filter,
)
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import hf_reference, prompt

V = 64


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("k", [1, 3, 10, V + 5])
def test_top_k_equals_hf_warper(k):
    logits = _logits()
    expected = TopKLogitsWarper(top_k=k)(None, logits.clone())
    assert torch.equal(top_k_filter(logits, torch.full((4,), k)), expected)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_equals_hf_warper(p):
    logits = _logits()
    expected = TopPLogitsWarper(top_p=p)(None, logits.clone())
    assert torch.equal(top_p_filter(logits, torch.full((4,), p)), expected)


def test_per_row_settings_and_min_keep():
    logits = _logits()
    mixed = top_k_filter(logits, torch.tensor([0, 2, 5, 1]), min_keep=2)
    assert (mixed.isfinite().sum(-1) == torch.tensor([V, 2, 5, 2])).all()
    nucleus = top_p_filter(logits, torch.tensor([1.0, 0.01, 0.5, 0.01]), min_keep=2)
    assert nucleus[0].isfinite().all()
    assert (nucleus[[1, 3]].isfinite().sum(-1) == 2).all()
    hf_half = TopPLogitsWarper(top_p=0.5)(None, logits[2:3].clone())
    assert torch.equal(nucleus[2:3], hf_half)


def test_temperature_and_repetition_penalty_equal_hf():
    logits = _logits()
    assert torch.equal(
        apply_temperature(logits, torch.full((4,), 0.7)),
        TemperatureLogitsWarper(0.7)(None, logits.clone()),
    )
    seen = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(3))
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    ours = apply_repetition_penalty(logits, list(seen), [1.3] * 4)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("kind", ["top_k", "top_p"])
def test_draws_stay_inside_the_mask(kind):
    logits = _logits(rows=8, seed=5)
    if kind == "top_k":
        masked = top_k_filter(logits, torch.full((8,), 4))
    else:
        masked = top_p_filter(logits, torch.full((8,), 0.6))
    allowed = masked.isfinite()
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    drawn = torch.stack([sample_rows(masked, gens) for _ in range(500)])  # [500, 8]
    assert allowed.gather(1, drawn.T).all()
    # Every allowed token with a fair share of mass shows up: the mask is not over-tight.
    probs = masked.softmax(-1)
    for row in range(8):
        likely = ((probs[row] > 0.05) & allowed[row]).nonzero().flatten().tolist()
        assert set(likely) <= set(drawn[:, row].tolist())


@pytest.fixture(scope="module")
def llama():
    _, ours, config = hf_reference("llama-gqa", seed=3)
    return ours, config


def _step_logits(model, prompt_ids, tokens):
    """Logits [T, V] that predicted each generated token, from one cache-free forward."""
    full = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(full)[0]
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)]


@pytest.mark.parametrize(
    "settings",
    [dict(top_k=3, temperature=1.5), dict(top_p=0.5, temperature=1.2), dict(top_k=5, top_p=0.7)],
)
def test_generated_tokens_stay_inside_top_k_and_nucleus(llama, settings):
    model, config = llama
    ids = prompt(5, config.vocab_size, seed=4)
    cfg = SamplingConfig(
        max_new_tokens=20, do_sample=True, num_return_sequences=4, seed=11, **settings
    )
    [results] = Engine(model, TokenizerInfo(config.vocab_size)).generate([ids], [cfg])
    for result in results:
        logits = _step_logits(model, ids, result.token_ids) / settings.get("temperature", 1.0)
        allowed = torch.ones_like(logits, dtype=torch.bool)
        if "top_k" in settings:
            allowed &= TopKLogitsWarper(settings["top_k"])(None, logits.clone()).isfinite()
        if "top_p" in settings:
            allowed &= TopPLogitsWarper(settings["top_p"])(None, logits.clone()).isfinite()
        picked = torch.tensor(result.token_ids)
        assert allowed.gather(1, picked[:, None]).all(), result.token_ids


def test_same_seed_same_output_different_seed_differs(llama):
    model, config = llama
    engine = Engine(model, TokenizerInfo(config.vocab_size))
    ids = prompt(5, config.vocab_size, seed=6)
    outs = {}
    for seed in (1, 1, 2):
        cfg = SamplingConfig(max_new_tokens=24, do_sample=True, temperature=1.5, seed=seed)
        [[result]] = engine.generate([ids], [cfg])
        assert result.seed == seed
        outs.setdefault(seed, []).append(result.token_ids)
    assert outs[1][0] == outs[1][1]
    assert outs[1][0] != outs[2][0]
    # n samples of one request use seeds seed .. seed + n - 1: sample 0 replays alone.
    cfg = SamplingConfig(
        max_new_tokens=24, do_sample=True, temperature=1.5, seed=1, num_return_sequences=3
    )
    [results] = engine.generate([ids], [cfg])
    assert [r.seed for r in results] == [1, 2, 3]
    assert results[0].token_ids == outs[1][0] and results[1].token_ids == outs[2][0]


def test_beam_sampling_is_reproducible(llama):
    model, config = llama
    engine = Engine(model, TokenizerInfo(config.vocab_size))
    ids = prompt(5, config.vocab_size, seed=7)

    def run(seed):
        cfg = SamplingConfig(
            max_new_tokens=12,
            do_sample=True,
            num_beams=3,
            top_k=8,
            seed=seed,
            num_return_sequences=2,
            temperature=1.5,
        )
        return [r.token_ids for r in engine.generate([ids], [cfg])[0]]

    first = run(5)
    assert run(5) == first
    assert any(run(seed) != first for seed in (6, 7, 8))


@pytest.mark.parametrize(
    "rows,vocab", [(8, 32000), (3, 32003), (1, 151936), (16, 4096), (6, 4096), (1, 32000)]
)
def test_blocked_argmax_gives_argmax_index_in_every_case(rows: int, vocab: int) -> None:
    """Random rows, then ties across and inside blocks and with the tail, NaN in the blocks
    and in the tail, all -inf and all equal rows: the same index as torch's argmax."""
    from engine.sampling import BLOCKED_ARGMAX_MIN, argmax_rows

    assert rows * vocab >= BLOCKED_ARGMAX_MIN  # the blocked path runs
    gen = torch.Generator().manual_seed(rows + vocab)
    x = torch.randn(rows, vocab, generator=gen)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    tail = vocab - 3 if vocab % 64 else vocab - 1
    cases = [
        {5: 9.0, 700: 9.0},  # a tie across blocks: the first
        {130: 9.0, 131: 9.0},  # a tie inside a block
        {vocab - 100: 9.0, tail: 9.0},  # a tie with the last element / tail
        {tail: 10.0},  # the maximum in the tail
        {900: float("nan"), 17: 50.0},  # NaN wins, as in argmax
        {tail: float("nan")},  # NaN in the tail
        {tail: float("nan"), 300: float("nan")},  # the first NaN
    ]
    for case in cases:
        y = x.clone()
        for i, value in case.items():
            y[0, i] = value
        assert torch.equal(argmax_rows(y), y.argmax(-1)), case
    flat = torch.full((rows, vocab), float("-inf"))
    assert torch.equal(argmax_rows(flat), flat.argmax(-1))
    same = torch.zeros(rows, vocab)
    assert torch.equal(argmax_rows(same), same.argmax(-1))


def test_sample_rows_draws_the_softmax_distribution_and_refuses_nan():
    """Inverse-CDF draws (one number a row): frequencies within 0.03 of softmax over 4000
    draws per row, a -inf token never drawn, a greedy row its arg-max, NaN logits refused."""
    logits = _logits(rows=3)[:, :8].clone()
    logits[0, 2] = float("-inf")
    logits[1, -1] = float("-inf")
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2), None]
    drawn = torch.stack([sample_rows(logits, gens) for _ in range(4000)])  # [4000, 3]
    probs = logits.softmax(-1)
    for row in range(2):
        freq = torch.bincount(drawn[:, row], minlength=8).float() / 4000
        assert (freq - probs[row]).abs().max() < 0.03
    assert not (drawn[:, 0] == 2).any() and not (drawn[:, 1] == 7).any()
    assert (drawn[:, 2] == logits[2].argmax()).all()
    bad = logits.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        sample_rows(bad, gens)
