"""engine.validation: every problem of a request at once, and Engine.submit refusing them."""

from __future__ import annotations

import math

import pytest

from engine.sampling import SamplingConfig
from engine.validation import (
    InvalidRequest,
    RequestLimits,
    fit_problems,
    request_problems,
    sampling_problems,
)

LIMITS = RequestLimits(max_new_tokens=64, max_num_beams=4, max_model_len=32, max_rows=4)


def _fields(config: SamplingConfig) -> list[str]:
    return [p.field for p in sampling_problems(config, LIMITS)]


def test_defaults_and_extremes_that_compute_finitely_pass():
    assert _fields(SamplingConfig()) == []
    extreme = SamplingConfig(
        do_sample=True, temperature=1e-30, top_k=2**31 - 1, top_p=1e-30, seed=2**63 - 1
    )
    assert _fields(extreme) == []
    assert _fields(SamplingConfig(num_beams=4, num_return_sequences=4, length_penalty=-10)) == []


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(repetition_penalty=1e-320), "repetition_penalty"),
        (dict(num_beams=2, length_penalty=math.nan), "length_penalty"),
        (dict(length_penalty=11.0), "length_penalty"),
        (dict(do_sample=True, top_k=2**63), "top_k"),
        (dict(do_sample=True, temperature=1e-45), "temperature"),
        (dict(do_sample=True, temperature=math.nan), "temperature"),
        (dict(do_sample=True, top_p=0.0), "top_p"),
        (dict(seed=2**64), "seed"),
        (dict(max_new_tokens=65), "max_new_tokens"),
        (dict(num_beams=5), "num_beams"),
        (dict(num_return_sequences=2), "num_return_sequences"),  # greedy gives one
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
        (dict(num_beams=2, logprobs=1), "logprobs"),
        (dict(stop=("",)), "stop"),
    ],
)
def test_each_bad_value_is_named(fields, named):
    assert _fields(SamplingConfig(**fields)) == [named]


def test_all_problems_together_and_fit():
    bad = SamplingConfig(do_sample=True, temperature=math.inf, top_p=math.nan, max_new_tokens=0)
    assert set(_fields(bad)) == {"temperature", "top_p", "max_new_tokens"}
    assert [p.field for p in fit_problems(32, SamplingConfig(), LIMITS)] == ["prompt"]
    [long] = fit_problems(20, SamplingConfig(max_new_tokens=13), LIMITS)
    assert long.field == "max_new_tokens" and "--max-model-len" in long.reason
    assert fit_problems(20, SamplingConfig(max_new_tokens=13), LIMITS, whole=False) == []
    beams = SamplingConfig(num_beams=4, num_return_sequences=1)
    assert fit_problems(3, beams, RequestLimits(max_rows=3))[0].field == "num_beams"
    vocab = RequestLimits(vocab_size=10)
    assert request_problems([3, 10], SamplingConfig(), vocab)[0].field == "prompt"
    assert request_problems([], SamplingConfig(), vocab)[0].field == "prompt"


def test_engine_submit_raises_invalid_request(tiny_engine):
    with pytest.raises(InvalidRequest) as caught:
        tiny_engine.submit([1, 2], SamplingConfig(do_sample=True, temperature=1e-45))
    assert [p.field for p in caught.value.problems] == ["temperature"]
    assert isinstance(caught.value, ValueError)


@pytest.fixture
def tiny_engine():
    from engine.engine import Engine, EngineConfig
    from engine.tokens import TokenizerInfo
    from tests.services.inference.helpers import hf_reference

    _, ours, config = hf_reference("llama-gqa", seed=1)
    return Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(max_batch_rows=2))
