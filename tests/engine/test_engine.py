"""Engine behaviour: continuous batching gives each request what it gets alone, requests join and
leave between steps, cancellation stops the work, stop strings cut the text, KV cache matches a
cache-free forward."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.requests import Finish, collect
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from kernels.packed_linear import PackedLinear
from models import build_model
from models.registry import get_config
from models.tokenizer import build_tokenizer
from services.inference.config import add_flags, from_args
from tests.kernels import test_cpu_hugepages as hugepage_tests
from tests.services.inference.helpers import hf_reference, prompt


@pytest.fixture(scope="module")
def model():
    _, ours, config = hf_reference("llama-gqa", seed=1)
    return ours, config


def _alone(model, config, ids, cfg):
    return Engine(model, TokenizerInfo(config.vocab_size)).generate([ids], [cfg])[0]


def test_batched_requests_equal_solo_runs(model):
    ours, config = model
    prompts = [prompt(n, config.vocab_size, seed=n) for n in (3, 9, 5, 14)]
    configs = [
        SamplingConfig(max_new_tokens=12),
        SamplingConfig(max_new_tokens=5),
        SamplingConfig(max_new_tokens=9, num_beams=3, num_return_sequences=2),
        SamplingConfig(max_new_tokens=10, do_sample=True, top_k=4, seed=3, num_return_sequences=2),
    ]
    engine = Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(max_batch_rows=16))
    together = engine.generate(prompts, configs)
    for ids, cfg, got in zip(prompts, configs, together, strict=True):
        solo = _alone(ours, config, ids, cfg)
        assert [r.token_ids for r in got] == [r.token_ids for r in solo]
        for a, b in zip(got, solo, strict=True):
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert engine.pool.num_rows == 0 and not engine.has_work()


def test_requests_join_between_steps_and_wait_for_rows(model):
    ours, config = model
    engine = Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(max_batch_rows=3))
    first = engine.submit(prompt(4, config.vocab_size, seed=1), SamplingConfig(max_new_tokens=8))
    events = []
    for _ in range(3):
        events += engine.step()
    assert engine.pool.num_rows == 1
    late = prompt(7, config.vocab_size, seed=2)
    beam_cfg = SamplingConfig(max_new_tokens=6, num_beams=3)
    second = engine.submit(late, beam_cfg)  # needs 3 rows: waits until the first one leaves
    third = engine.submit(prompt(2, config.vocab_size, seed=3), SamplingConfig(max_new_tokens=4))
    rows_seen = []
    while engine.has_work():
        events += engine.step()
        rows_seen.append(engine.pool.num_rows)
    assert max(rows_seen) <= 3
    by_request = {rid: [e for e in events if e.request_id == rid] for rid in (first, second, third)}
    assert (
        collect(by_request[first], 1)[0].token_ids
        == _alone(
            ours, config, prompt(4, config.vocab_size, seed=1), SamplingConfig(max_new_tokens=8)
        )[0].token_ids
    )
    assert [r.token_ids for r in collect(by_request[second], 1)] == [
        r.token_ids for r in _alone(ours, config, late, beam_cfg)
    ]
    assert len(collect(by_request[third], 1)[0].token_ids) == 4


def test_cancel_stops_computing(model):
    ours, config = model
    engine = Engine(ours, TokenizerInfo(config.vocab_size))
    keep = engine.submit(prompt(4, config.vocab_size), SamplingConfig(max_new_tokens=30))
    drop = engine.submit(prompt(4, config.vocab_size), SamplingConfig(max_new_tokens=30))
    for _ in range(3):
        engine.step()
    engine.cancel(drop)
    events = engine.step()
    assert [e.finish for e in events if e.request_id == drop] == [Finish.CANCELLED]
    computed = engine.tokens_computed[drop]
    while engine.has_work():
        events += engine.step()
    assert engine.tokens_computed[drop] == computed
    assert engine.tokens_computed[keep] == 4 + 29  # prompt, then one fed token per later step
    assert [e.finish for e in events if e.request_id == keep][-1] == Finish.LENGTH


def test_kv_cache_logits_match_a_full_forward(model):
    ours, config = model
    engine = Engine(ours, TokenizerInfo(config.vocab_size))
    ids = prompt(6, config.vocab_size, seed=9)
    [[result]] = engine.generate([ids], [SamplingConfig(max_new_tokens=10)])
    with torch.no_grad():
        full = torch.log_softmax(ours(torch.tensor([ids + result.token_ids]))[0], -1)
    picked = full[5:-1].gather(1, torch.tensor(result.token_ids)[:, None]).sum().item()
    assert result.cumulative_logprob == pytest.approx(picked, abs=1e-4)
    assert full[5:-1].argmax(-1).tolist() == result.token_ids


def test_context_length_ends_a_sequence(model):
    ours, config = model
    engine = Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(max_model_len=12))
    assert not engine.fits_context(10, 3)
    [[result]] = engine.generate(
        [prompt(10, config.vocab_size)], [SamplingConfig(max_new_tokens=2)]
    )
    assert len(result.token_ids) == 2 and result.finish == Finish.LENGTH


def test_stop_string_cuts_text_and_streams_nothing_past_it(sentencepiece_model):
    tokenizer = build_tokenizer("SentencePiece", sentencepiece_model)
    big = hf_reference("llama-gqa", seed=1, vocab_size=tokenizer.vocab_size)[1]
    tokens = TokenizerInfo.from_tokenizer(tokenizer, tokenizer.vocab_size)
    engine = Engine(big, tokens)
    ids = tokens.encode_prompt("The model")
    [[free]] = engine.generate([ids], [SamplingConfig(max_new_tokens=20)])
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    cut = text.find(stop)
    request = engine.submit(ids, SamplingConfig(max_new_tokens=20, stop=(stop, "never-seen")))
    events = []
    while engine.has_work():
        events += engine.step()
    [result] = collect([e for e in events if e.request_id == request], 1)
    assert result.finish == Finish.STOP_STRING
    assert result.text == text[:cut]
    assert len(result.token_ids) < len(free.token_ids)
    assert result.token_ids == free.token_ids[: len(result.token_ids)]


@pytest.mark.parametrize("cpu_linear", ["dense", "packed+gemv", "colmajor"])
def test_cpu_linear_layouts_give_the_same_tokens(cpu_linear):
    """Dense, packed, packed+gemv (batch-1 steps take the gemv copy) and column-major linears
    agree."""
    _, packed_model, config = hf_reference("llama-gqa", seed=1)
    other = hf_reference("llama-gqa", seed=1)[1]
    prompts = [prompt(n, config.vocab_size, seed=n) for n in (5, 8)]
    configs = [SamplingConfig(max_new_tokens=8), SamplingConfig(max_new_tokens=6, num_beams=2)]
    tokens = TokenizerInfo(config.vocab_size)
    packed = EngineConfig(cpu_linear="packed")
    solo = Engine(packed_model, tokens, packed).generate(prompts[:1], configs[:1])
    batched = Engine(packed_model, tokens, packed).generate(prompts, configs)
    engine = Engine(other, tokens, EngineConfig(cpu_linear=cpu_linear))
    qkv = other.layers["0"].self_attn.qkv_proj
    if cpu_linear == "dense":
        assert type(qkv) is torch.nn.Linear and qkv.weight.is_contiguous()
    elif cpu_linear == "colmajor":
        assert type(qkv) is torch.nn.Linear and qkv.weight.t().is_contiguous()
    else:
        assert isinstance(qkv, PackedLinear) and qkv.gemv_weight is not None
    for got, expected in (
        (engine.generate(prompts[:1], configs[:1]), solo),
        (engine.generate(prompts, configs), batched),
    ):
        for got_request, expected_request in zip(got, expected, strict=True):
            for a, b in zip(got_request, expected_request, strict=True):
                assert a.token_ids == b.token_ids
                # fp32 summation order differs between the layouts: logprobs agree closely.
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("cpu_linear", ["packed", "packed+gemv"])
def test_compiled_decode_gives_the_eager_tokens(cpu_linear):
    """compile_decode: rows of unequal lengths (masked keys), requests joining later, batch sizes
    1..5, beams and sampling decode exactly as the eager engine, with no graph breaks."""
    torch._dynamo.reset()  # a fresh recompile budget and counters for this test
    counters = torch._dynamo.utils.counters
    counters.clear()
    _, eager_model, config = hf_reference("llama-gqa", seed=1)
    compiled_model = hf_reference("llama-gqa", seed=1)[1]
    tokens = TokenizerInfo(config.vocab_size)
    prompts = [prompt(n, config.vocab_size, seed=n) for n in (5, 8, 3)]
    configs = [
        SamplingConfig(max_new_tokens=9),
        SamplingConfig(max_new_tokens=7, num_beams=2),
        SamplingConfig(max_new_tokens=6, do_sample=True, top_k=5, seed=4),
    ]
    results = []
    for model, compile_decode in ((eager_model, False), (compiled_model, True)):
        engine = Engine(
            model, tokens, EngineConfig(cpu_linear=cpu_linear, compile_decode=compile_decode)
        )
        first = engine.generate(prompts[:1], configs[:1])
        ids = [engine.submit(p, c) for p, c in zip(prompts[:2], configs[:2], strict=True)]
        events = engine.step() + engine.step()
        ids.append(engine.submit(prompts[2], configs[2]))  # joins a running batch
        while engine.has_work():
            events += engine.step()
        by_request = [[e for e in events if e.request_id == rid] for rid in ids]
        results.append([first[0], *(collect(ev, 1) for ev in by_request)])
    assert counters["stats"]["unique_graphs"] >= 2  # the decode steps did run compiled
    assert not counters["graph_break"]
    for eager, compiled in zip(*results, strict=True):
        for a, b in zip(eager, compiled, strict=True):
            assert a.token_ids == b.token_ids
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


def test_compile_decode_is_cpu_only():
    config = get_config("tiny-llama-gqa")
    off_cpu = build_model(config, device="meta")
    with pytest.raises(ValueError, match="--compile-decode is for CPU serving"):
        Engine(off_cpu, TokenizerInfo(config.vocab_size), EngineConfig(compile_decode=True))


def test_compile_decode_flag_serves_from_one_process():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    assert from_args(parser.parse_args(["--compile-decode"])).compile_decode
    with pytest.raises(ValueError, match="--compile-decode serves from one process"):
        from_args(parser.parse_args(["--compile-decode", "--tensor-parallel-size", "2"]))


def test_cpu_linear_choice_is_checked():
    with pytest.raises(ValueError, match="--cpu-linear must be one of"):
        EngineConfig(cpu_linear="fast")


@hugepage_tests.needs_thp
def test_cpu_engine_serves_weights_from_huge_pages_with_the_same_tokens(monkeypatch):
    import engine.model_runner as runner_module
    from kernels.cpu.hugepages import Moved

    model = hugepage_tests._model()
    plain = copy.deepcopy(model)
    tokens = TokenizerInfo(4096)
    ids = prompt(9, 4096, seed=4)
    cfg = SamplingConfig(max_new_tokens=12)
    dense = EngineConfig(cpu_linear="dense")  # weights as loaded (auto may pack them)
    served = Engine(model, tokens, dense)
    advised = hugepage_tests._mapping(model.lm_head.weight.data_ptr())["VmFlags"].split()
    assert "hg" in advised
    monkeypatch.setattr(runner_module, "move_to_huge_pages", lambda m: Moved(0, 0, "off"))
    # The reference engine leaves its weights where they are. (Whether that memory already
    # carries the advice is the allocator's business: after earlier tests it may hand out memory
    # next to, or once part of, an advised range, so only "unchanged" is checked.)
    before = hugepage_tests._mapping(plain.lm_head.weight.data_ptr())
    pointer = plain.lm_head.weight.data_ptr()
    reference = Engine(plain, tokens, dense)
    assert plain.lm_head.weight.data_ptr() == pointer
    assert hugepage_tests._mapping(pointer)["VmFlags"] == before["VmFlags"]
    got = served.generate([ids], [cfg])[0][0].token_ids
    assert len(got) == 12
    assert got == reference.generate([ids], [cfg])[0][0].token_ids


def test_kv_usage_gauge_counts_ring_slots_not_positions():
    # A sliding-window model's rows are rings of W slots: a row past W positions fills W of
    # them, and the gauge must not read over 1 (it read positions / max_seq_len before).
    from prometheus_client import REGISTRY

    from services.inference import metrics

    _, ours, config = hf_reference("mistral", seed=1)
    window = config.sliding_window
    engine = Engine(
        ours, TokenizerInfo(config.vocab_size), EngineConfig(max_batch_rows=2, max_model_len=64)
    )
    assert engine.pool.cache.is_ring and engine.pool.slot_capacity == 2 * window
    # The gauges are read at scrape time from the last step's values while the engine has work
    # (issue 37): instrument the engine so its step records them, as the service does.
    metrics.instrument(engine)
    engine.submit(prompt(3 * window, config.vocab_size), SamplingConfig(max_new_tokens=8))
    engine.submit(prompt(3, config.vocab_size, seed=1), SamplingConfig(max_new_tokens=8))
    engine.step()
    lengths = engine.pool.lengths()
    assert lengths[0] > window and lengths[1] < window and engine.has_work()
    expected = (window + lengths[1]) / (2 * window)
    gauge = REGISTRY.get_sample_value("meshline_inference_kv_cache_tokens_usage_ratio")
    assert gauge == pytest.approx(expected)
