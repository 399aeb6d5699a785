"""Structured output in the engine: every sequence's tokens follow its request's grammar (its own
matcher per row, batched beside free rows; beams each their own copy, equal to HF's constrained
beam search), and bad grammars are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.grammar import (
    GrammarError,
    GrammarMatcher,
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
)
from engine.requests import Finish
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from engine.validation import InvalidRequest
from models.tokenizer import build_tokenizer
from tests.services.inference.helpers import hf_generate, hf_reference, prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(hf_tokenizer_dir):
    tokenizer = build_tokenizer("PretrainedFromHF", hf_tokenizer_dir)
    _, ours, config = hf_reference("llama-gqa", seed=1, vocab_size=tokenizer.vocab_size)
    tokens = TokenizerInfo.from_tokenizer(tokenizer, config.vocab_size)
    return Engine(ours, tokens, EngineConfig(max_batch_rows=8))


def test_batched_rows_each_follow_their_grammar(engine):
    vocab = engine.tokens.vocab_size
    schema = json_schema_grammar(SCHEMA)
    regex = regex_grammar(r"[0-9]{3}-[a-z]{2}")
    choice = choice_grammar(["yes", "no", "maybe"])
    prompts = [prompt(n, vocab, seed=n) for n in (5, 8, 3, 6)]
    configs = [
        SamplingConfig(max_new_tokens=80, grammar=schema),
        SamplingConfig(
            max_new_tokens=80, do_sample=True, seed=7, num_return_sequences=3, grammar=schema
        ),
        SamplingConfig(max_new_tokens=20, do_sample=True, seed=1, grammar=regex),
        SamplingConfig(max_new_tokens=10, grammar=choice),
    ]
    free = SamplingConfig(max_new_tokens=12)
    results = engine.generate([*prompts, prompts[0]], [*configs, free])
    decode = engine.tokens.decode
    for result in results[0] + results[1]:
        assert result.token_ids[-1] == engine.tokens.eos_id, "the grammar completes, then EOS"
        jsonschema.validate(json.loads(decode(result.token_ids)), SCHEMA)
    assert len({decode(r.token_ids) for r in results[1]}) > 1, "each sample its own matcher"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", decode(results[2][0].token_ids))
    assert decode(results[3][0].token_ids) in ("yes", "no", "maybe")
    # The unconstrained row beside them is what it is alone.
    assert results[4][0].token_ids == engine.generate([prompts[0]], [free])[0][0].token_ids


def test_a_bad_grammar_is_refused_by_name(engine):
    ids = prompt(4, engine.tokens.vocab_size, seed=1)
    bad = regex_grammar("[a-")
    with pytest.raises(InvalidRequest) as caught:
        engine.submit(ids, SamplingConfig(grammar=bad))
    assert caught.value.problems[0].field == "grammar"


@pytest.fixture(scope="module")
def engine_and_hf(hf_tokenizer_dir):
    tokenizer = build_tokenizer("PretrainedFromHF", hf_tokenizer_dir)
    hf, ours, config = hf_reference("llama-gqa", seed=4, vocab_size=tokenizer.vocab_size)
    tokens = TokenizerInfo.from_tokenizer(tokenizer, config.vocab_size)
    return Engine(ours, tokens, EngineConfig(max_batch_rows=8)), hf


@pytest.mark.parametrize(
    ("grammar", "beams", "returned"),
    [
        (json_schema_grammar(SCHEMA), 3, 2),
        (choice_grammar(["yes", "no", "maybe", "never"]), 2, 2),
        (regex_grammar(r"[0-9]{2,4}-[a-z]{1,3}"), 4, 3),
    ],
    ids=["json_schema", "choice", "regex"],
)
def test_beam_search_with_a_grammar_equals_hf_constrained_beam_search(
    engine_and_hf, grammar, beams, returned
):
    """Beams each follow their own copy of the grammar: the hypotheses equal HF `generate` beam
    search whose `prefix_allowed_tokens_fn` asks the same grammar (llguidance) per prefix. The
    budget leaves room to finish: near the limit beams are steered to complete (HF's are cut
    mid-answer), tested below."""
    engine, hf = engine_and_hf
    vocab, eos = engine.tokens.vocab_size, engine.tokens.eos_id
    ids = prompt(6, vocab, seed=beams)

    def allowed(_: int, prefix: torch.Tensor) -> list[int]:
        matcher = GrammarMatcher(grammar, engine.tokens)
        try:
            for token in prefix[len(ids) :].tolist():
                matcher.advance(token)
        except GrammarError:  # a beam that is not live (score -1e9) in HF's bookkeeping
            return [eos]
        return np.flatnonzero(matcher.allowed(hf.config.vocab_size)).tolist() or [eos]

    config = SamplingConfig(
        max_new_tokens=64, num_beams=beams, num_return_sequences=returned, grammar=grammar
    )
    ours = [r.token_ids for r in engine.generate([ids], [config])[0]]
    theirs = hf_generate(
        hf, ids, max_new_tokens=64, num_beams=beams, num_return_sequences=returned,
        eos_token_id=eos, pad_token_id=engine.tokens.pad_id or 0,
        prefix_allowed_tokens_fn=allowed, early_stopping=False, length_penalty=1.0,
    )  # fmt: skip
    expected = []
    for row in theirs[:, len(ids) :].tolist():
        expected.append(row[: row.index(eos) + 1] if eos in row else row)
    assert ours == expected
    for token_ids in ours:
        matcher = GrammarMatcher(grammar, engine.tokens)
        for token in token_ids[:-1]:
            matcher.advance(token)  # every hypothesis follows the grammar to its EOS


def test_grammar_rows_beside_speculation_decode_plainly(engine):
    """A speculative engine does not speculate in a step with a grammar row (its matcher is not
    rolled back with rejected drafts): the grammar row and a free row give the plain engine's
    tokens."""
    from engine.speculative_config import SpeculativeConfig

    spec = Engine(
        engine.model,
        engine.tokens,
        EngineConfig(max_batch_rows=8, speculative_config=SpeculativeConfig("ngram", 3, 3, 1)),
    )
    vocab = engine.tokens.vocab_size
    prompts = [prompt(6, vocab, seed=3), prompt(7, vocab, seed=4)]
    configs = [
        SamplingConfig(max_new_tokens=40, grammar=json_schema_grammar(SCHEMA)),
        SamplingConfig(max_new_tokens=15),
    ]
    plain = engine.generate(prompts, configs)
    ours = spec.generate(prompts, configs)
    assert [r[0].token_ids for r in ours] == [r[0].token_ids for r in plain]
    jsonschema.validate(json.loads(engine.tokens.decode(ours[0][0].token_ids)), SCHEMA)


UNBOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"},
        "code": {"type": "string", "pattern": "^(ab)+c$"},
        "year": {"type": "integer", "minimum": 1450},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 2},
        "note": {"type": "string"},
    },
    "required": ["name", "email", "code", "year", "tags"],
    "additionalProperties": False,
}


def test_a_tight_token_budget_still_ends_in_json_that_validates(engine):
    """Strings the schema leaves unbounded (a random model writes them until the limit) are
    closed in time: at every budget from the shortest answer up, greedy and sampled answers
    parse, validate with `jsonschema` and end with finish STOP, never cut."""
    grammar = json_schema_grammar(UNBOUNDED)
    shortest = len(GrammarMatcher(grammar, engine.tokens).plan())
    ids = prompt(5, engine.tokens.vocab_size, seed=11)
    decode = engine.tokens.decode
    budgets = [shortest, shortest + 1, shortest + 7, 2 * shortest, 120]
    configs = [SamplingConfig(max_new_tokens=b, grammar=grammar) for b in budgets]
    configs += [
        SamplingConfig(
            max_new_tokens=b, do_sample=True, seed=b, num_return_sequences=3, grammar=grammar
        )
        for b in budgets[1:4]
    ]
    results = engine.generate([ids] * len(configs), configs)
    for config, result in zip(configs, results, strict=True):
        for answer in result:
            assert len(answer.token_ids) <= config.max_new_tokens
            text = decode([t for t in answer.token_ids if t != engine.tokens.eos_id])
            jsonschema.validate(json.loads(text), UNBOUNDED)
            assert answer.finish is Finish.STOP, (config.max_new_tokens, text)


def test_a_budget_below_the_shortest_answer_is_refused_by_name(engine):
    grammar = json_schema_grammar(UNBOUNDED)
    shortest = len(GrammarMatcher(grammar, engine.tokens).plan())
    ids = prompt(4, engine.tokens.vocab_size, seed=1)
    with pytest.raises(InvalidRequest) as caught:
        engine.submit(ids, SamplingConfig(max_new_tokens=shortest - 1, grammar=grammar))
    assert caught.value.problems[0].field == "max_new_tokens"
    assert f"takes {shortest} tokens" in caught.value.problems[0].reason


@pytest.mark.parametrize(
    ("grammar", "check"),
    [
        (regex_grammar(r"(ab)+c"), lambda text: re.fullmatch(r"(ab)+c", text)),
        (
            regex_grammar(r"[a-z0-9.]+@[a-z0-9]+\.[a-z]{2,3}"),
            lambda text: re.fullmatch(r"[a-z0-9.]+@[a-z0-9]+\.[a-z]{2,3}", text),
        ),
        (choice_grammar(["Zürich", "Genève"]), lambda text: text in ("Zürich", "Genève")),
        (
            json_schema_grammar({"enum": ["été", 12, None]}),
            lambda t: json.loads(t) in ("été", 12, None),
        ),
        (json_schema_grammar(True), lambda text: json.loads(text) is not Ellipsis),
    ],
    ids=["cycle", "email", "choice", "enum", "any-json"],
)
def test_plans_complete_every_kind_of_grammar(engine, grammar, check):
    """A fresh matcher's plan, consumed, is an answer the grammar accepts."""
    matcher = GrammarMatcher(grammar, engine.tokens)
    plan = matcher.plan()
    assert plan is not None
    for token in plan:
        matcher.advance(token)
    assert matcher.allowed(engine.tokens.vocab_size)[engine.tokens.eos_id], "accepting: EOS may end"
    assert check(engine.tokens.decode(plan))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_beams_under_a_tight_budget_end_in_json_that_validates(engine, sampled):
    """Beam search steers too: a candidate after which its beam's grammar could not complete in
    the tokens left is dropped like a forbidden token, so every hypothesis returned, even one
    finished at the length limit, parses and validates."""
    grammar = json_schema_grammar(UNBOUNDED)
    shortest = len(GrammarMatcher(grammar, engine.tokens).plan())
    ids = prompt(5, engine.tokens.vocab_size, seed=12)
    decode = engine.tokens.decode
    configs = [
        SamplingConfig(
            max_new_tokens=budget, num_beams=3, num_return_sequences=2, grammar=grammar,
            do_sample=sampled, seed=budget,
        )
        for budget in (shortest, shortest + 3, shortest + 12)
    ]  # fmt: skip
    for config, result in zip(configs, engine.generate([ids] * 3, configs), strict=True):
        for answer in result:
            assert len(answer.token_ids) <= config.max_new_tokens
            text = decode([t for t in answer.token_ids if t != engine.tokens.eos_id])
            jsonschema.validate(json.loads(text), UNBOUNDED)


def test_a_plan_finishes_a_character_split_across_tokens(engine):
    """A byte-level token may end inside a multi-byte character (the lead byte of `é`): the
    plan finishes the character, then the string, so such a pick is not overridden."""
    from engine.grammar import grammar_tokenizer

    vocab = grammar_tokenizer(engine.tokens)
    matcher = GrammarMatcher(json_schema_grammar({"type": "string"}), engine.tokens)
    taken = [vocab.tokenize_bytes(b'"')[0], vocab.tokenize_bytes(b"\xc3")[0]]
    for token in taken:
        matcher.advance(token)
    plan = matcher.plan()
    assert plan is not None
    text = vocab.decode_bytes(taken + plan).decode("utf-8")
    assert isinstance(json.loads(text), str) and len(json.loads(text)) == 1
