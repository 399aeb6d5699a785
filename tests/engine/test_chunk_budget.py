"""The time-sized prompt chunk (engine/chunk_budget.py): the step a chunk joins stays within
STEP_TIME_FACTOR of a decode-only step, on a modelled cost and in the engine's own loop."""

from __future__ import annotations

import pytest

from engine.chunk_budget import STEP_TIME_FACTOR, ChunkBudget
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from tests.services.inference.helpers import hf_reference, prompt


def test_no_decoding_rows_or_no_timing_leaves_the_token_budget():
    budget = ChunkBudget()
    assert budget.tokens(rows=4, cap=100) == 100  # nothing timed yet
    budget.decoded(0.1)
    assert budget.tokens(rows=0, cap=100) == 100  # nobody waits on the step
    # Before any chunk is timed, a prompt token is taken to cost a decode row.
    assert budget.tokens(rows=8, cap=100) == int((STEP_TIME_FACTOR - 1) * 8)


@pytest.mark.parametrize(
    ("fixed_s", "per_token_s", "decode_s"),
    [(0.005, 0.012, 0.15), (0.001, 0.0001, 0.02), (0.03, 0.02, 0.15)],
)
def test_chunks_converge_to_the_step_time_bound(fixed_s, per_token_s, decode_s):
    """A chunk of n tokens costs fixed + n x per_token (a CPU's compute-bound prefill, a GPU's
    nearly free one, a large fixed cost): the chunk settles where the step stays in bound."""
    budget = ChunkBudget()
    chunks = []
    for _ in range(40):
        budget.decoded(decode_s)
        n = budget.tokens(rows=8, cap=2040)
        budget.prefilled(n, fixed_s + n * per_token_s)
        chunks.append(n)
    settled = chunks[-1]
    step = decode_s + fixed_s + settled * per_token_s
    assert step <= STEP_TIME_FACTOR * decode_s * 1.02
    best = int(((STEP_TIME_FACTOR - 1) * decode_s - fixed_s) / per_token_s)
    assert settled >= min(2040, 0.9 * best)  # not needlessly small either


def test_a_long_prompt_beside_a_decoding_row_is_chunked_under_the_default_budget():
    _, ours, config = hf_reference("llama-gqa", seed=1)
    engine = Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(max_batch_rows=4))
    assert engine.chunk_budget is not None and engine.runner.max_num_batched_tokens == 2048
    short, long = prompt(4, config.vocab_size, seed=1), prompt(120, config.vocab_size, seed=2)
    cfg = SamplingConfig(max_new_tokens=10)
    first = engine.submit(short, cfg)
    got = {first: engine.step()[0].token_ids}
    second = engine.submit(long, cfg)
    got[second] = []
    steps = 0
    while not got[second]:
        steps += 1
        for event in engine.step():
            got[event.request_id] += event.token_ids
    # One step would take the whole prompt under the 2048-token budget; beside a decoding
    # row its first chunk is sized from the decode step's time (one token before any chunk
    # was timed), so the prompt takes several.
    assert steps >= 2
    while engine.has_work():
        for event in engine.step():
            got[event.request_id] += event.token_ids
    whole = Engine(
        ours, TokenizerInfo(config.vocab_size), EngineConfig(enable_chunked_prefill=False)
    )
    expected = [r[0].token_ids for r in whole.generate([short, long], [cfg, cfg])]
    assert [got[first], got[second]] == expected
    # A budget given explicitly is a fixed token budget (vLLM's meaning), not time-sized.
    fixed = Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(max_num_batched_tokens=64))
    assert fixed.chunk_budget is None
