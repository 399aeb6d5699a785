"""Speculative decoding: greedy output equals plain decoding and HF generate token for token,
sampled output has the target's distribution (the rejection rule), and bad configs are refused
by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from scipy import stats

from engine.engine import Engine, EngineConfig
from engine.kv_blocks import chain_hashes
from engine.native_step import NativeStep
from engine.requests import GenerationRequest
from engine.sampling import SamplingConfig
from engine.speculative import accept_or_resample, check_same_vocabulary, ngram_draft
from engine.speculative_config import SpeculativeConfig, parse_speculative_config
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import EOS_ID, hf_generate, hf_reference, prompt

VOCAB = 16
"""A tiny vocabulary: a random model's greedy output then repeats itself, so n-gram drafts are
accepted as well as rejected."""


def ngram(k: int = 4, **extra) -> SpeculativeConfig:
    return parse_speculative_config(
        json.dumps({"method": "ngram", "num_speculative_tokens": k, **extra})
    )


@pytest.fixture(scope="module")
def tiny():
    hf, ours, config = hf_reference("llama-gqa", seed=3, vocab_size=VOCAB)
    return hf, ours, config


def _engine(model, config, spec=None, draft=None, rows=8):
    return Engine(
        model,
        TokenizerInfo(config.vocab_size, eos_id=EOS_ID),
        EngineConfig(max_batch_rows=rows, speculative_config=spec, cpu_linear="dense"),
        draft_model=draft,
    )


def _perturbed(model, scale):
    """A copy of `model` with Gaussian noise of std `scale` added to every weight."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen))
    return draft


def _ids(results):
    return [[r.token_ids for r in seqs] for seqs in results]


def test_config_takes_vllm_spelling_and_defaults():
    spec = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = parse_speculative_config('{"method": "[ngram]", "num_speculative_tokens": 2}')
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's defaults


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not JSON"),
        ("[1]", "expected a JSON object"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key(s) ['typo']"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'method' must be one of"),
        ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "'num_speculative_tokens' must be"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "'num_speculative_tokens' must"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
            '"prompt_lookup_max": 2}',
            "'prompt_lookup_min' (3) must be <=",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "'model' is for"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
        ('{"model": "/nonexistent/draft", "num_speculative_tokens": 2}', "not an existing"),
        (
            '{"model": ".", "num_speculative_tokens": 2, "prompt_lookup_max": 2}',
            "'prompt_lookup_max' is for method 'ngram'",
        ),
    ],
)
def test_config_refuses_by_name(text, message):
    with pytest.raises(ValueError, match="--speculative-config") as info:
        parse_speculative_config(text)
    assert message in str(info.value)


def test_ngram_draft_takes_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert ngram_draft(context, 3, 1, 2) == [8, 2, 5]  # "5 6" last seen at 4..5
    assert ngram_draft([*context, 9], 2, 1, 3) == []  # 9 never occurred before
    assert ngram_draft([1, 2, 3, 1, 2], 4, 2, 2) == [3, 1, 2]  # capped by the context's end
    assert ngram_draft([3, 4, 4], 2, 1, 1) == [4]
    assert ngram_draft([1, 2, 3], 0, 1, 2) == []


@pytest.mark.parametrize("k", [1, 4, 8])  # k + 1 = 9 tokens: past the C step, the module forward
def test_greedy_ngram_equals_plain_and_hf_generate(tiny, k):
    hf, ours, config = tiny
    prompts = [prompt(n, VOCAB, seed=n) for n in (5, 9, 13)]
    configs = [
        SamplingConfig(max_new_tokens=60),
        SamplingConfig(max_new_tokens=41, repetition_penalty=1.3),
        SamplingConfig(max_new_tokens=50, logprobs=2),
    ]
    plain = _engine(ours, config).generate(prompts, configs)
    spec_engine = _engine(ours, config, ngram(k, prompt_lookup_min=1, prompt_lookup_max=3))
    spec = spec_engine.generate(prompts, configs)
    assert _ids(spec) == _ids(plain)
    for a, b in zip(spec, plain, strict=True):
        assert a[0].cumulative_logprob == pytest.approx(b[0].cumulative_logprob, abs=1e-4)
        assert a[0].finish == b[0].finish
    stats_ = spec_engine.speculation.stats
    assert 0 < stats_.accepted < stats_.drafted  # drafts kept and drafts rolled back
    for ids, cfg, got in zip(prompts[:1], configs[:1], spec[:1], strict=True):
        hf_ids = hf_generate(hf, ids, max_new_tokens=cfg.max_new_tokens)[0, len(ids) :].tolist()
        assert got[0].token_ids == hf_ids
    assert spec_engine.pool.num_rows == 0 and not spec_engine.has_work()


def _rows_of(runner, prompts):
    """Admit and prefill `prompts` into the runner's paged pool as active rows 0, 1, ..."""
    pool = runner.pool
    for rid, ids in enumerate(prompts, start=1):
        prefill = pool.admit(GenerationRequest(rid, ids, SamplingConfig(max_new_tokens=16)))
        runner.prefill_chunk([prefill], len(ids), runner.last_logits)
        pool.join(prefill)
        # Blocks for a verification of up to 7 tokens, as Engine._make_room promises them.
        assert pool.blocks.cover(rid, pool.blocks_to_write(pool.num_rows - 1, 8))


def _slots(pool, row, length):
    """Flat block slots of row `row`'s first `length` positions."""
    p = pool.block_size
    return [pool.tables[row][i // p] * p + i % p for i in range(length)]


def test_verification_in_c_matches_the_module_forward(tiny):
    """k+1 tokens of one row in one C call (NativeStep.verify) over its block table: every
    position's logits and the keys/values written equal the module forward's to fp32 rounding."""
    _, ours, config = tiny
    runner = _engine(ours, config, ngram(4)).runner
    assert runner.paged and isinstance(runner.decode_step, NativeStep)
    assert runner.decode_step.max_rows >= 5
    pool = runner.pool
    ids = prompt(7, VOCAB, seed=2)
    _rows_of(runner, [ids, ids])
    draft = [3, 9, 9, 4, 12]
    c_logits = runner.forward_tokens(0, draft)
    view = pool.view(1, 2)
    module_logits = ours(torch.tensor([draft]), kv_cache=view)[0]
    pool.sync(view, 1)
    torch.testing.assert_close(c_logits, module_logits, rtol=1e-4, atol=1e-4)
    assert pool.lengths() == [12, 12]
    for store in (pool.k_blocks, pool.v_blocks):
        for buf in store.values():
            flat = buf.view(-1, *buf.shape[2:])
            torch.testing.assert_close(
                flat[_slots(pool, 0, 12)], flat[_slots(pool, 1, 12)], rtol=1e-5, atol=1e-5
            )
    runner.truncate(0, 9)
    assert pool.lengths() == [9, 12]


def test_rollback_frees_the_blocks_past_the_kept_length(tiny):
    _, ours, config = tiny
    runner = _engine(ours, config, ngram(4)).runner
    pool = runner.pool
    _rows_of(runner, [prompt(15, VOCAB, seed=4)])  # one block, one slot left
    used = pool.blocks.used
    credit = pool.blocks.reserved
    runner.forward_tokens(0, [5, 6, 7, 8, 9])  # positions 15-19: a second block
    assert pool.blocks.used == used + 1 and pool.blocks.reserved == credit - 1
    runner.truncate(0, 17)  # keeps two accepted: still in the second block
    assert len(pool.tables[0]) == 2 and pool.blocks.used == used + 1
    runner.truncate(0, 16)  # every draft rejected: the second block goes back, with its credit
    assert len(pool.tables[0]) == 1 and pool.blocks.used == used
    assert pool.blocks.reserved == credit
    pool.gather([])
    pool.settle(set())
    assert pool.blocks.used == 0 and pool.blocks.reserved == 0


def test_greedy_draft_model_equals_plain(tiny):
    _, ours, config = tiny
    draft = _perturbed(ours, 0.05)  # a different model that agrees often: accepts and rejections
    prompts = [prompt(n, VOCAB, seed=n) for n in (4, 7)]
    configs = [SamplingConfig(max_new_tokens=40), SamplingConfig(max_new_tokens=33, stop=())]
    plain = _engine(ours, config).generate(prompts, configs)
    spec = SpeculativeConfig("draft_model", 3, model=Path("."))
    engine = _engine(ours, config, spec, draft=draft)
    assert _ids(engine.generate(prompts, configs)) == _ids(plain)
    assert 0 < engine.speculation.stats.accepted < engine.speculation.stats.drafted


def _check_references(engine):
    """Every block's reference count is the number of tables (active rows, prefills) naming it,
    and every block is held, cached or free exactly once."""
    pool = engine.pool
    held = [0] * pool.blocks.num_blocks
    for table in [*pool.tables, *(p.table for p in engine._prefills)]:
        for block in table:
            held[block] += 1
    assert held == pool.blocks.refs
    assert pool.blocks.used == sum(1 for n in held if n)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_paged_blocks_with_prefix_cache_is_exact_and_leaks_nothing(tiny, method):
    """4-token blocks, prefix caching and a 12-token step budget (prompts chunked): 24 requests
    over one shared prefix, greedy, penalised and sampled (n = 2: rows sharing blocks, copy on
    write), drafts crossing block edges and rolled back. Greedy tokens equal plain decoding and
    HF generate; after every step each block's count equals the tables naming it; at the end
    every block is free or cached and no credit is left."""
    hf, ours, config = tiny
    spec, draft = ngram(4, prompt_lookup_min=1, prompt_lookup_max=3), None
    if method == "draft_model":
        spec, draft = SpeculativeConfig("draft_model", 3, model=Path(".")), _perturbed(ours, 0.05)
    fields = dict(max_batch_rows=8, block_size=4, cpu_linear="dense", max_num_batched_tokens=12)
    tokens = TokenizerInfo(config.vocab_size, eos_id=EOS_ID)
    engine = Engine(
        ours, tokens, EngineConfig(**fields, speculative_config=spec), draft_model=draft
    )
    plain = Engine(ours, tokens, EngineConfig(**fields, enable_prefix_caching=False))
    assert engine.runner.paged and engine.runner.prefix_caching
    shared = prompt(10, VOCAB, seed=8)
    prompts = [shared + prompt(1 + i % 5, VOCAB, seed=20 + i) for i in range(24)]
    kinds = [
        SamplingConfig(max_new_tokens=30),
        SamplingConfig(max_new_tokens=23, repetition_penalty=1.3),
        SamplingConfig(max_new_tokens=17, do_sample=True, seed=4, num_return_sequences=2),
    ]
    configs = [kinds[i % 3] for i in range(24)]
    got: dict[int, list[list[int]]] = {}
    order = []
    for wave in range(3):  # later waves find the shared prefix cached
        for i in range(8 * wave, 8 * wave + 8):
            rid = engine.submit(prompts[i], configs[i])
            order.append(rid)
            got[rid] = [[] for _ in range(configs[i].num_return_sequences)]
        while engine.has_work():
            for event in engine.step():
                got[event.request_id][event.index] += event.token_ids
            _check_references(engine)
    stats_ = engine.speculation.stats
    assert 0 < stats_.accepted < stats_.drafted
    assert engine.pool.blocks.stats.hit_tokens >= 16 * 8  # two shared blocks, waves 2 and 3
    greedy = [i for i in range(24) if not configs[i].do_sample]
    expected = plain.generate([prompts[i] for i in greedy], [configs[i] for i in greedy])
    assert [got[order[i]] for i in greedy] == _ids(expected)
    hf_ids = hf_generate(hf, prompts[0], max_new_tokens=30)[0, len(prompts[0]) :].tolist()
    assert got[order[0]][0] == hf_ids
    for i in range(24):
        assert all(len(t) == configs[i].max_new_tokens or t[-1] == EOS_ID for t in got[order[i]])
    blocks = engine.pool.blocks
    assert blocks.used == 0 and blocks.reserved == 0 and not any(blocks.refs)
    assert blocks.free == blocks.num_blocks and blocks.cached > 0


def test_next_turn_finds_the_blocks_speculation_kept(tiny):
    """Blocks filled by verified drafts are named for the next turn; positions written by drafts
    that were not kept (also at the step that ends a sequence) never are: a follow-up prompt of
    prompt + answer gives plain decoding's tokens with its answer's blocks found cached."""
    _, ours, config = tiny
    fields = dict(max_batch_rows=8, block_size=4, cpu_linear="dense")
    tokens = TokenizerInfo(config.vocab_size, eos_id=EOS_ID)
    spec = ngram(4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = Engine(ours, tokens, EngineConfig(**fields, speculative_config=spec))
    plain = Engine(ours, tokens, EngineConfig(**fields, enable_prefix_caching=False))
    firsts = [prompt(n, VOCAB, seed=40 + n) for n in (5, 7, 9)]
    cfg = SamplingConfig(max_new_tokens=27)
    answers = [r[0] for r in _ids(engine.generate(firsts, [cfg] * 3))]
    assert answers == [r[0] for r in _ids(plain.generate(firsts, [cfg] * 3))]
    stats_ = engine.pool.blocks.stats
    for first, answer in zip(firsts, answers, strict=True):
        follow = first + answer + [3, 5]
        before = stats_.hit_tokens
        got = _ids(engine.generate([follow], [cfg]))
        assert got == _ids(plain.generate([follow], [cfg]))
        cached = len(first) + len(answer) - 1
        assert stats_.hit_tokens - before == cached // 4 * 4
    assert 0 < engine.speculation.stats.accepted < engine.speculation.stats.drafted


def test_positions_of_drafts_not_kept_are_never_named(tiny):
    """A step that ends a sequence returns without rolling back: its cache holds drafts past the
    kept tokens. Naming the row's blocks stops before the first position whose key is not
    that of the sequence's token there."""
    _, ours, _ = tiny
    fields = dict(block_size=4, cpu_linear="dense", speculative_config=ngram(4))
    runner = Engine(ours, TokenizerInfo(VOCAB), EngineConfig(**fields)).runner
    pool = runner.pool
    first = prompt(7, VOCAB, seed=6)
    _rows_of(runner, [first])
    written = [5, 6, 7, 8, 9]  # pending 5 and four drafts: positions 7-11, three full blocks
    runner.forward_tokens(0, written)
    # Kept: 5, 6, 7, 8 (positions 7-10); the token after them is 4, not the draft 9 written at
    # position 11: the third block [8, 11] holds a key that is not its token's.
    pool.name_generated(0, first, [5, 6, 7, 8, 4])
    digests = chain_hashes([*first, 5, 6, 7, 8, 4], 4)
    assert [pool.blocks.is_registered(d) for d in digests] == [True, True, False]
    pool.name_generated(0, first, [*written, 1])  # every draft kept: the third block is named
    assert pool.blocks.is_registered(chain_hashes(first + written, 4)[2])


def test_beam_requests_decode_plainly_beside_speculation(tiny):
    _, ours, config = tiny
    prompts = [prompt(6, VOCAB, seed=1), prompt(8, VOCAB, seed=2)]
    configs = [
        SamplingConfig(max_new_tokens=12, num_beams=3, num_return_sequences=2),
        SamplingConfig(max_new_tokens=20),
    ]
    plain = _engine(ours, config).generate(prompts, configs)
    spec = _engine(ours, config, ngram(3, prompt_lookup_min=1)).generate(prompts, configs)
    assert _ids(spec) == _ids(plain)


@pytest.mark.parametrize("one_hot", [True, False])
def test_rejection_rule_keeps_the_target_distribution(one_hot):
    p_V = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    q_V = None if one_hot else torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    gen = torch.Generator().manual_seed(0)
    qgen = torch.Generator().manual_seed(1)
    n = 8_000
    counts = torch.zeros(5)
    for _ in range(n):
        draft = 1 if q_V is None else int(torch.multinomial(q_V, 1, generator=qgen)[0])
        counts[accept_or_resample(p_V.log(), draft, q_V, gen)] += 1
    assert counts[4] == 0
    _, pvalue = stats.chisquare(counts[:4].numpy(), (p_V[:4] * n).numpy())
    assert pvalue > 1e-3


def _exact_joint(model, ids, top_k, steps):
    """P(first `steps` tokens) of top-k sampling from `model`, by enumeration."""
    from engine.sampling import top_k_filter

    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, prob in out.items():
            with torch.no_grad():
                logits_V = model(torch.tensor([ids + list(prefix)]))[0, -1].float()
            p_V = top_k_filter(logits_V[None], torch.tensor([top_k]))[0].softmax(-1)
            for t in torch.nonzero(p_V)[:, 0].tolist():
                nxt[(*prefix, t)] = prob * float(p_V[t])
        out = nxt
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model"])
def test_sampled_speculation_matches_the_target_distribution(tiny, method):
    """First 3 tokens of 1,500 sampled requests (different seeds) against the exact top-4
    distribution (chi-square and TV distance): without speculation (the harness's control),
    with one-token n-gram drafts (token 2 accepted or resampled, token 3 the bonus after an
    acceptance), and with two-token drafts sampled from a perturbed copy of the model."""
    _, ours, config = tiny
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)).tolist()
    exact = _exact_joint(ours, ids, top_k=4, steps=3)
    n = 1500
    configs = [SamplingConfig(max_new_tokens=3, do_sample=True, top_k=4, seed=s) for s in range(n)]
    spec, draft = None, None
    if method == "ngram":
        spec = ngram(1, prompt_lookup_min=1)
    elif method == "draft_model":
        spec = SpeculativeConfig("draft_model", 2, model=Path("."))
        draft = _perturbed(ours, 0.3)
    engine = _engine(ours, config, spec, draft=draft, rows=64)
    counts: dict[tuple[int, ...], int] = {}
    for start in range(0, n, 250):
        batch = configs[start : start + 250]
        for seqs in engine.generate([ids] * len(batch), batch):
            key = tuple(seqs[0].token_ids[:3])
            counts[key] = counts.get(key, 0) + 1
    if spec is not None:
        assert 0 < engine.speculation.stats.accepted < engine.speculation.stats.drafted
    cells = sorted(exact)
    assert set(counts) <= set(exact)
    observed = [counts.get(c, 0) for c in cells]
    expected = [exact[c] * n for c in cells]
    scale = sum(observed) / sum(expected)  # float rounding of the enumerated probabilities
    _, pvalue = stats.chisquare(observed, [e * scale for e in expected])
    tv = 0.5 * sum(abs(o / n - exact[c]) for o, c in zip(observed, cells, strict=True))
    assert pvalue > 1e-4 and tv < 0.08, (pvalue, tv)


def test_sliding_window_model_is_refused():
    _, ours, config = hf_reference("mistral", seed=0)
    with pytest.raises(ValueError, match="--speculative-config: the model has a sliding window"):
        _engine(ours, config, ngram(2))


def test_draft_vocabulary_must_match():
    target = TokenizerInfo(32)
    with pytest.raises(ValueError, match="draft model has 48 vocabulary rows, the served model 32"):
        check_same_vocabulary(target, 32, TokenizerInfo(48), 48, "--speculative-config model")
    check_same_vocabulary(target, 32, TokenizerInfo(32), 32, "--speculative-config model")
    with pytest.raises(ValueError, match="eos_id is 2, the served model's 1"):
        check_same_vocabulary(
            TokenizerInfo(32, eos_id=1, tokenizer=object()),
            32,
            TokenizerInfo(32, eos_id=2, tokenizer=object()),
            32,
            "--speculative-config model",
        )


def test_speculating_rows_preempted_for_blocks_give_plain_tokens(tiny):
    """Blocks taken as tokens come, with drafts: each step promises a row the blocks of its
    verification (1 + k positions); rows preempted when the 10 blocks run out are recomputed
    and every request's tokens equal plain decoding's."""
    _, ours, config = tiny
    slot = len(ours.layers) * 2 * ours.config.kv_heads * ours.config.head_dim * 4
    spec = Engine(
        ours,
        TokenizerInfo(VOCAB, eos_id=EOS_ID),
        EngineConfig(
            max_batch_rows=8,
            max_model_len=64,
            kv_cache_memory=10 * 16 * slot,
            cpu_linear="dense",
            speculative_config=ngram(4, prompt_lookup_min=1, prompt_lookup_max=3),
        ),
    )
    prompts = [prompt(12, VOCAB, seed=s) for s in range(5)]
    cfgs = [SamplingConfig(max_new_tokens=36)] * 5  # 3 blocks each at full length, 15 > 10
    got = _ids(spec.generate(prompts, cfgs))
    assert spec.preemptions >= 1 and spec.speculation.stats.drafted > 0
    assert got == _ids(_engine(ours, config).generate(prompts, cfgs))
    assert spec.pool.blocks.used == 0 and spec.pool.blocks.reserved == 0
