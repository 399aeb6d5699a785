"""The paged KV cache: blocks shared by prompt prefix, LRU eviction, copy on write, requests
queued when blocks are short, chunked prefill between decode steps, the C step on block
tables; every output equal to the engine without the feature (and HF's, test_hf_parity)."""

from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.kv_blocks import BlockAllocator, chain_hashes
from engine.native_step import NativeStep
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import hf_reference, prompt


@pytest.fixture(scope="module")
def model():
    _, ours, config = hf_reference("llama-gqa", seed=1)
    return ours, config


def _engine(model, **fields) -> Engine:
    ours, config = model
    fields.setdefault("max_batch_rows", 8)
    return Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(**fields))


def _tokens(results):
    return [[r.token_ids for r in request] for request in results]


def test_chain_hashes_name_prefixes_not_blocks():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = chain_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3  # full blocks only
    assert a[1] != b[1]  # same tokens [3, 4], different prefix
    assert chain_hashes([1, 2, 3, 4], 2) == a[:2]


def test_allocator_evicts_the_least_recently_released_cached_block():
    blocks = BlockAllocator(3, 2, prefix_caching=True)
    blocks.reserve(1, 3, [])
    held = [blocks.allocate(1) for _ in range(3)]
    for block, digest in zip(held, (b"a", b"b", b"c"), strict=True):
        blocks.register(block, digest)
    for block in (held[1], held[0], held[2]):  # released in this order
        blocks.decref(block)
    blocks.release(1)
    assert blocks.free == 3 and blocks.cached == 3 and blocks.used == 0
    assert blocks.lookup([b"a", b"b"]) == [held[0], held[1]]
    blocks.reserve(2, 1, [held[0]])  # a hit: held again, no longer evictable
    assert blocks.allocate(2) == held[1]  # the least recently released of the others
    assert not blocks.is_registered(b"b") and blocks.is_registered(b"c")
    with pytest.raises(RuntimeError, match="beyond its reservation"):
        blocks.allocate(2)
    assert not blocks.can_reserve(2, [])  # one block (c) left to promise
    assert blocks.can_reserve(1, [])


def test_shared_prefix_is_computed_once_and_gives_the_same_tokens(model):
    _, config = model
    system = prompt(40, config.vocab_size, seed=7)
    prompts = [system + prompt(5, config.vocab_size, seed=s) for s in (1, 2, 3)]
    cfg = SamplingConfig(max_new_tokens=6)
    plain = _engine(model, enable_prefix_caching=False)
    expected = [_tokens(plain.generate([p], [cfg])) for p in prompts]
    engine = _engine(model)
    got = [_tokens(engine.generate([p], [cfg])) for p in prompts]
    assert got == expected
    ids = sorted(engine.tokens_computed)
    # The first computes its prompt; the others find its two full 16-token blocks cached.
    assert [engine.tokens_computed[i] for i in ids] == [45 + 5, 13 + 5, 13 + 5]
    stats = engine.pool.blocks.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (3 * 32, 2 * 32)
    assert plain.pool.blocks.stats.hit_tokens == 0 and plain.pool.blocks.cached == 0


def test_requests_admitted_together_wait_for_the_prefix_in_flight(model):
    _, config = model
    system = prompt(48, config.vocab_size, seed=4)
    prompts = [[*system, 5 + i] for i in range(4)]
    cfg = SamplingConfig(max_new_tokens=3)
    engine = _engine(model)
    got = _tokens(engine.generate(prompts, [cfg] * 4))
    plain = _engine(model, enable_prefix_caching=False)
    assert got == _tokens(plain.generate(prompts, [cfg] * 4))
    computed = [engine.tokens_computed[i] for i in sorted(engine.tokens_computed)]
    assert computed == [49 + 2, 1 + 2, 1 + 2, 1 + 2]  # prompt, then a decode step a token


def _slot_bytes(model) -> int:
    """Keys and values of one token over every layer (fp32)."""
    ours, _ = model
    return len(ours.layers) * 2 * ours.config.kv_heads * ours.config.head_dim * 4


def test_eviction_when_blocks_are_short_keeps_outputs_exact(model):
    _, config = model
    engine = _engine(model, max_model_len=64, kv_cache_memory=8 * 16 * _slot_bytes(model))
    assert engine.cache_plan.blocks == 8
    plain = _engine(model, enable_prefix_caching=False)
    first = prompt(40, config.vocab_size, seed=1)
    cfg = SamplingConfig(max_new_tokens=4)
    wide = SamplingConfig(max_new_tokens=24, do_sample=True, seed=3, num_return_sequences=3)
    runs = [(first, cfg), (prompt(40, config.vocab_size, seed=2), wide), (first, cfg)]
    for ids, c in runs:
        assert _tokens(engine.generate([ids], [c])) == _tokens(plain.generate([ids], [c]))
    # The first run left its two full prompt blocks cached; the second needed all 8 blocks
    # (2 shared prompt blocks + 2 per row), so it evicted them: the third run hit nothing.
    stats = engine.pool.blocks.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (3 * 32, 0)
    # Cached at the end: the second run's 2 prompt blocks and the block each of its 3 rows
    # filled while decoding (positions 32-47), and the third run's 2 prompt blocks.
    assert engine.pool.blocks.used == 0 and engine.pool.blocks.cached == 7


def test_n_rows_share_the_prompt_blocks_and_copy_on_write(model):
    _, config = model
    ids = prompt(21, config.vocab_size, seed=3)  # one full block and a partial one
    cfg = SamplingConfig(max_new_tokens=8, do_sample=True, top_k=8, seed=5, num_return_sequences=3)
    engine = _engine(model)
    engine.submit(ids, cfg)
    engine.step()  # prefill: one row computed, three rows holding its two blocks
    tables = engine.pool.tables
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
    assert [engine.pool.blocks.refs[b] for b in tables[0]] == [3, 3]
    engine.step()  # each row writes token 21 into the partial block: two copy it first
    assert len({t[1] for t in engine.pool.tables}) == 3
    assert len({t[0] for t in engine.pool.tables}) == 1
    while engine.has_work():
        engine.step()
    got = _tokens(engine.generate([ids], [cfg]))
    plain = _engine(model, enable_prefix_caching=False, enable_chunked_prefill=False)
    # Each sequence is what a single-sequence request with its seed gives.
    for i, tokens in enumerate(got[0]):
        solo = SamplingConfig(max_new_tokens=8, do_sample=True, top_k=8, seed=5 + i)
        assert [tokens] == _tokens(plain.generate([ids], [solo]))[0]
    assert engine.pool.blocks.used == 0 and engine.pool.blocks.reserved == 0


def test_requests_beyond_the_blocks_are_preempted_and_recomputed_exactly(model):
    """Blocks are taken as tokens are generated: more requests run at once than fit at their
    full max_tokens; when blocks run out the most recently admitted is preempted, recomputed
    later from its prompt and tokens so far, and every output equals the request run alone."""
    _, config = model
    engine = _engine(
        model,
        max_model_len=64,
        kv_cache_memory=12 * 16 * _slot_bytes(model),
        enable_prefix_caching=False,
    )
    assert engine.cache_plan.blocks == 12
    # Prompt 30 + 18 new tokens: 3 blocks a request at full length, so 4 of the 6 would fit;
    # prompt + first token take 2 blocks, so all 6 are admitted.
    cfg = SamplingConfig(max_new_tokens=18)
    prompts = [prompt(30, config.vocab_size, seed=seed) for seed in range(6)]
    ids = [engine.submit(p, cfg) for p in prompts]
    results: dict[int, list[int]] = {}
    loads = []
    while engine.has_work():
        for event in engine.step():
            assert event.error is None
            results.setdefault(event.request_id, []).extend(event.token_ids)
        loads.append(engine.load())
    assert loads[0] == (6, 0)
    # Writing position 32 needs a third block each: the two newest leave for the four oldest.
    assert loads[2] == (6, 0) and loads[3] == (4, 2) and engine.preemptions >= 2
    plain = _engine(model, enable_prefix_caching=False)
    alone = [_tokens(plain.generate([p], [cfg]))[0][0] for p in prompts]
    assert [results[i] for i in ids] == alone
    assert engine.pool.blocks.used == 0 and engine.pool.blocks.reserved == 0
    # One that could never fit (1 + 4 rows x 3 blocks) is refused at submission.
    too_wide = SamplingConfig(max_new_tokens=30, do_sample=True, num_return_sequences=4)
    with pytest.raises(ValueError, match="needs 13 KV blocks of 16 tokens; the cache holds 12"):
        engine.submit(prompt(30, config.vocab_size), too_wide)


def test_a_preempted_sampled_request_draws_the_same_tokens(model):
    """Recompute preemption keeps a sampled request's generator: its tokens equal its run alone
    (seeded), and cancelling it while preempted ends it cleanly."""
    _, config = model
    engine = _engine(model, max_model_len=64, kv_cache_memory=5 * 16 * _slot_bytes(model))
    sampled = SamplingConfig(max_new_tokens=30, do_sample=True, top_k=20, seed=11)
    prompts = [prompt(14, config.vocab_size, seed=s) for s in (21, 22)]
    got = _tokens(engine.generate(prompts, [sampled, sampled]))
    assert engine.preemptions >= 1
    plain = _engine(model)
    assert got == [_tokens(plain.generate([p], [sampled]))[0] for p in prompts]
    assert engine.pool.blocks.used == 0 and engine.pool.blocks.reserved == 0


def test_chunked_prefill_interleaves_with_decoding_rows(model):
    _, config = model
    short = prompt(4, config.vocab_size, seed=1)
    long = prompt(100, config.vocab_size, seed=2)
    cfg = SamplingConfig(max_new_tokens=12)
    engine = _engine(model, max_batch_rows=4, max_num_batched_tokens=21)
    first = engine.submit(short, cfg)
    [event] = engine.step()
    second = engine.submit(long, cfg)
    steps_with_first = 0
    got: dict[int, list[int]] = {first: event.token_ids, second: []}
    while not got[second]:
        events = engine.step()
        steps_with_first += any(e.request_id == first and e.token_ids for e in events)
        for e in events:
            got[e.request_id] += e.token_ids
    # 100 prompt tokens at 20 a step (one of the 21 goes to the decoding row): five steps, the
    # short request decoding in each of them.
    assert steps_with_first == 5
    while engine.has_work():
        for e in engine.step():
            got[e.request_id] += e.token_ids
    whole = _engine(model, enable_chunked_prefill=False)
    expected = _tokens(whole.generate([short, long], [cfg, cfg]))
    assert [got[first], got[second]] == [t[0] for t in expected]


def test_c_step_reads_block_tables(model):
    _, config = model
    engine = _engine(model)
    assert isinstance(engine.runner.decode_step, NativeStep)
    lean = _engine(model, decode_step="lean")
    prompts = [prompt(n, config.vocab_size, seed=n) for n in (3, 17, 33)]
    cfgs = [SamplingConfig(max_new_tokens=20)] * 3
    assert _tokens(engine.generate(prompts, cfgs)) == _tokens(lean.generate(prompts, cfgs))


def test_flags_needing_pages_are_refused_where_rows_are_dense(model):
    with pytest.raises(ValueError, match="--enable-prefix-caching needs the paged KV cache"):
        _engine(model, compile_decode=True, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="--block-size needs the paged KV cache"):
        _engine(model, compile_decode=True, block_size=32)
    with pytest.raises(ValueError, match="--max-num-batched-tokens is the chunked-prefill"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="must exceed --max-batch-rows"):
        EngineConfig(max_batch_rows=8, max_num_batched_tokens=8)


def test_a_budget_of_four_dense_rows_serves_sixteen_short_requests_at_once(model):
    _, config = model
    row = config.max_position_embeddings * (_slot_bytes(model) + 1)  # a dense row, with mask
    engine = _engine(model, max_batch_rows=16, kv_cache_memory=4 * row)
    assert engine.cache_plan.blocks == 4 * config.max_position_embeddings // 16
    prompts = [prompt(10, config.vocab_size, seed=s) for s in range(16)]
    cfg = SamplingConfig(max_new_tokens=6)
    for p in prompts:
        engine.submit(p, cfg)
    engine.step()
    assert engine.load() == (16, 0)  # every request decoding: one block each
    while engine.has_work():
        engine.step()
    assert engine.pool.blocks.used == 0


def test_requests_admitted_together_share_the_step_budget(model):
    _, config = model
    prompts = [prompt(30, config.vocab_size, seed=s) for s in range(4)]
    cfg = SamplingConfig(max_new_tokens=5)
    engine = _engine(model, max_num_batched_tokens=50, enable_prefix_caching=False)
    for p in prompts:
        engine.submit(p, cfg)
    results = {e.request_id: e.token_ids for e in engine.step()}
    assert sum(engine.tokens_computed.values()) == 50  # 30 + 20, the others wait their turn
    while engine.has_work():
        for event in engine.step():
            results.setdefault(event.request_id, []).extend(event.token_ids)
    whole = _engine(model, enable_chunked_prefill=False)
    expected = [t[0] for t in _tokens(whole.generate(prompts, [cfg] * 4))]
    assert [results[i] for i in sorted(results)] == expected


def test_generated_blocks_are_cached_for_the_next_turn(model):
    """A chat's next turn (prompt + answer + new text) finds the blocks the answer filled:
    hit counters and tokens computed exact, tokens equal to an engine without prefix caching."""
    _, config = model
    first = prompt(20, config.vocab_size, seed=5)
    cfg = SamplingConfig(max_new_tokens=40)
    engine = _engine(model)
    plain = _engine(model, enable_prefix_caching=False)
    [[answer]] = _tokens(engine.generate([first], [cfg]))
    assert [[answer]] == _tokens(plain.generate([first], [cfg]))
    assert len(answer) == 40
    # 59 positions cached (the last answer token was never fed): three full blocks, one of
    # them the prompt's, two filled while decoding; all three are named.
    stats = engine.pool.blocks.stats
    assert engine.pool.blocks.cached == 3
    follow = first + answer + prompt(5, config.vocab_size, seed=6)
    before = (stats.queried_tokens, stats.hit_tokens)
    got = _tokens(engine.generate([follow], [cfg]))
    assert got == _tokens(plain.generate([follow], [cfg]))
    assert (stats.queried_tokens - before[0], stats.hit_tokens - before[1]) == (4 * 16, 3 * 16)
    assert engine.tokens_computed[max(engine.tokens_computed)] == 65 - 48 + 39
    # Rows sharing a prompt (n = 2, sampled) fill blocks of their own; both answers are named.
    wide = SamplingConfig(max_new_tokens=20, do_sample=True, seed=1, num_return_sequences=2)
    [[a, b]] = _tokens(engine.generate([first], [wide]))
    assert a != b
    for answer_ in (a, b):
        before = stats.hit_tokens
        engine.generate([first + answer_ + [7]], [SamplingConfig(max_new_tokens=1)])
        assert stats.hit_tokens - before == 32  # 41 tokens: the prompt's block and one more
    assert engine.pool.blocks.used == 0 and engine.pool.blocks.reserved == 0


def test_small_chunks_prefill_in_the_c_step_with_unchunked_tokens(model):
    """A chunk within the C step's rows runs as one C call reading the blocks in place (no
    per-layer gather of the context), beside a decoding row: tokens equal unchunked prefill."""
    _, config = model
    engine = _engine(model, max_batch_rows=2, max_num_batched_tokens=7)
    step = engine.runner.decode_step
    assert isinstance(step, NativeStep) and step.max_rows >= 7
    calls = []
    verify = step.verify
    step.verify = lambda ids, cache: calls.append(len(ids)) or verify(ids, cache)
    short, long = prompt(5, config.vocab_size, seed=3), prompt(70, config.vocab_size, seed=4)
    cfg = SamplingConfig(max_new_tokens=9)
    got = _tokens(engine.generate([short, long], [cfg, cfg]))
    assert calls and max(calls) <= 7 and sum(calls) >= 70 + 5  # both prompts, in chunks
    whole = _engine(model, enable_chunked_prefill=False)
    assert got == _tokens(whole.generate([short, long], [cfg, cfg]))
