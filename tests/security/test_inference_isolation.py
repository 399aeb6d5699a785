"""Hostile inference requests are contained: innocent requests beside them finish unchanged.

Every case runs its hostile call(s) while innocent streams (greedy, seeded sampling with two
sequences, beam search) are mid-generation on the same engine, then checks by side effect: each
innocent stream finishes with exactly the tokens it produced alone, the hostile call gets its
own specific status (never UNKNOWN / INTERNAL), and the server still answers health SERVING.
The engine-level cases inject a failure into one request's part of a batched step (seeding,
prefill forward, sampling, stop strings, beam step) and check that only that request fails.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import engine as engine_module
from engine.beam_search import BeamSearch
from engine.detokenize import TextTracker
from engine.engine import Engine
from engine.native_step import NativeStep
from engine.requests import RequestError, StepEvent, collect
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from services.common.config import ServerConfig
from services.common.server import create_server
from services.inference.config import InferenceServiceConfig
from services.inference.servicer import SERVICE_NAME, bindings, load_engine
from tests.services.inference.helpers import hf_reference, prompt, save_hf_checkpoint

VOCAB = 512
TEXT_LIMIT = 4_000_000
HEALTH_BOUND_S = 1.5
"""Health must answer within this while a maximal Tokenize runs (it took seconds on the loop)."""
INNOCENTS = [
    pb.GenerateRequest(
        prompt_token_ids=prompt(6, VOCAB, seed=1), params=pb.SamplingParams(max_new_tokens=90)
    ),
    pb.GenerateRequest(
        prompt_token_ids=prompt(6, VOCAB, seed=2),
        params=pb.SamplingParams(
            max_new_tokens=90, do_sample=True, top_k=40, seed=11, num_return_sequences=2
        ),
    ),
    pb.GenerateRequest(
        prompt_token_ids=prompt(7, VOCAB, seed=3),
        params=pb.SamplingParams(max_new_tokens=60, num_beams=2, num_return_sequences=2),
    ),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    hf, _, _ = hf_reference("llama-gqa", seed=2, vocab_size=VOCAB)
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"), sentencepiece_model)
    config = InferenceServiceConfig(load=directory, max_batch_rows=16, max_text_chars=TEXT_LIMIT)
    engine = load_engine(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port, _ = asyncio.run_coroutine_threadsafe(
        create_server(bindings(config, engine), ServerConfig(host="127.0.0.1", port=0)), loop
    ).result(30)
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.max_send_message_length", 64 * 2**20),
            ("grpc.max_receive_message_length", 64 * 2**20),
        ],
    )
    stub = pb_grpc.InferenceServiceStub(channel)
    alone = [_stream(stub, request) for request in INNOCENTS]
    yield stub, health_pb2_grpc.HealthStub(channel), engine, alone
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    asyncio.run_coroutine_threadsafe(engine.front.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _stream(
    stub: pb_grpc.InferenceServiceStub,
    request: pb.GenerateRequest,
    started: threading.Barrier | None = None,
) -> dict[int, list[int]]:
    """Token ids per sequence index of one streamed request (waits at `started` once going)."""
    tokens: dict[int, list[int]] = {}
    for message in stub.GenerateStream(request, timeout=120):
        first = not tokens
        tokens.setdefault(message.index, []).extend(message.token_ids)
        if first and started is not None:
            started.wait(60)
    return tokens


def _contained(served, hostile: Callable[[pb_grpc.InferenceServiceStub], object]) -> object:
    """Run `hostile` while the innocent streams are generating; check they were unaffected."""
    stub, health, _, alone = served
    started = threading.Barrier(len(INNOCENTS) + 1)
    with ThreadPoolExecutor(len(INNOCENTS)) as pool:
        futures = [pool.submit(_stream, stub, r, started) for r in INNOCENTS]
        started.wait(60)
        outcome = hostile(stub)
        results = [f.result(180) for f in futures]
    assert results == alone
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return outcome


def _refused(call: Callable[[], object], code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value.details()
    assert field in caught.value.details()


def _generate(**params: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt(5, VOCAB, seed=9), params=pb.SamplingParams(**params)
    )


HOSTILE_GENERATE = {
    "seed-2**64-1": (_generate(do_sample=True, seed=2**64 - 1, num_return_sequences=2), "seed"),
    "seed-2**63": (_generate(do_sample=True, seed=2**63), "params.seed"),
    "num_return_sequences-huge": (
        _generate(do_sample=True, num_return_sequences=2**31 - 1),
        "params.num_return_sequences",
    ),
    "num_beams-huge": (_generate(num_beams=2**31 - 1), "params.num_beams"),
    "temperature-nan": (_generate(do_sample=True, temperature=float("nan")), "temperature"),
    "temperature-inf": (_generate(do_sample=True, temperature=float("inf")), "temperature"),
    "temperature-negative": (_generate(do_sample=True, temperature=-1.0), "temperature"),
    "top_p-nan": (_generate(do_sample=True, top_p=float("nan")), "params.top_p"),
    "top_p-negative": (_generate(do_sample=True, top_p=-0.5), "params.top_p"),
    "repetition_penalty-inf": (
        _generate(repetition_penalty=float("inf")),
        "params.repetition_penalty",
    ),
    "length_penalty-nan": (
        _generate(num_beams=2, length_penalty=float("nan")),
        "params.length_penalty",
    ),
    "max_new_tokens-huge": (_generate(max_new_tokens=2**31 - 1), "params.max_new_tokens"),
    "max_new_tokens-negative": (_generate(max_new_tokens=-5), "params.max_new_tokens"),
    "stop-list-huge": (_generate(stop=["x"] * 10_000), "params.stop"),
    "stop-string-huge": (_generate(stop=["y" * 100_000]), "params.stop"),
    "prompt-chars-huge": (pb.GenerateRequest(prompt="z" * (TEXT_LIMIT + 1)), "prompt"),
    "prompt-ids-huge": (
        pb.GenerateRequest(prompt_token_ids=[5] * (TEXT_LIMIT + 1)),
        "prompt_token_ids",
    ),
    "prompt-ids-negative": (pb.GenerateRequest(prompt_token_ids=[5, -7]), "prompt_token_ids"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_GENERATE))
def test_hostile_generate_is_refused_and_contained(served, case):
    request, field = HOSTILE_GENERATE[case]

    def hostile(stub):
        _refused(
            lambda: stub.Generate(request, timeout=60), grpc.StatusCode.INVALID_ARGUMENT, field
        )
        _refused(
            lambda: list(stub.GenerateStream(request, timeout=60)),
            grpc.StatusCode.INVALID_ARGUMENT,
            field,
        )

    _contained(served, hostile)


def test_prompt_past_the_context_is_invalid_and_contained(served):
    long_prompt = pb.GenerateRequest(prompt_token_ids=prompt(400, VOCAB, seed=4))

    def hostile(stub):
        _refused(
            lambda: stub.Generate(long_prompt, timeout=60),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt_token_ids",
        )

    _contained(served, hostile)


def test_nine_overflow_seed_calls_beside_innocent_streams(served):
    """The issue's reproduction: overflowing seeds beside streams used to fail them all."""
    request = HOSTILE_GENERATE["seed-2**64-1"][0]

    def hostile(stub):
        with ThreadPoolExecutor(9) as pool:
            calls = [pool.submit(stub.Generate, request, timeout=60) for _ in range(9)]
            for call in calls:
                with pytest.raises(grpc.RpcError) as caught:
                    call.result()
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    _contained(served, hostile)


def test_valid_extreme_sampling_values_are_served_beside_innocents(served):
    extreme = _generate(
        do_sample=True,
        top_k=2**31 - 1,
        top_p=1e-30,
        temperature=1e-30,
        seed=2**63 - 1,
        max_new_tokens=5,
        num_return_sequences=3,
    )

    def hostile(stub):
        reply = stub.Generate(extreme, timeout=60)
        assert [s.seed for s in reply.sequences] == [2**63 - 1 + i for i in range(3)]
        assert all(len(s.token_ids) >= 1 for s in reply.sequences)

    _contained(served, hostile)


def test_hostile_score_is_refused_and_contained(served):
    item = pb.ScoreItem(context_token_ids=prompt(60, VOCAB), continuation_token_ids=[5] * 60)
    too_many_items = pb.ScoreRequest(items=[item] * 5000)
    too_many_tokens = pb.ScoreRequest(items=[item] * 600)  # 72 000 tokens > 65 536
    huge_text = pb.ScoreRequest(
        items=[pb.ScoreItem(context="w" * (TEXT_LIMIT + 1), continuation="x")]
    )

    def hostile(stub):
        _refused(
            lambda: stub.Score(too_many_items, timeout=60),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items",
        )
        _refused(
            lambda: stub.Score(too_many_tokens, timeout=60),
            grpc.StatusCode.INVALID_ARGUMENT,
            "items",
        )
        _refused(
            lambda: stub.Score(huge_text, timeout=60), grpc.StatusCode.INVALID_ARGUMENT, "items[0]"
        )

    _contained(served, hostile)


def test_oversized_messages_are_refused_before_they_are_read(served):
    giant = pb.TokenizeRequest(text="a" * (38 * 2**20))  # the 38 MB Tokenize
    ids = pb.DetokenizeRequest(token_ids=[5] * (TEXT_LIMIT + 1))

    def hostile(stub):
        _refused(lambda: stub.Tokenize(giant, timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
        _refused(
            lambda: stub.Detokenize(ids, timeout=60), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"
        )
        _refused(
            lambda: stub.Tokenize(pb.TokenizeRequest(text="b" * (TEXT_LIMIT + 1)), timeout=60),
            grpc.StatusCode.INVALID_ARGUMENT,
            "text",
        )

    _contained(served, hostile)


def test_health_answers_while_a_maximal_tokenize_runs(served):
    stub, health, _, _ = served
    text = ("The model runs fast. " * (TEXT_LIMIT // 21 + 1))[:TEXT_LIMIT]
    done = threading.Event()
    latencies: list[float] = []

    def tokenize():
        try:
            return stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120)
        finally:
            done.set()

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(tokenize)
        started = time.monotonic()
        time.sleep(0.2)
        while not done.is_set():
            t0 = time.monotonic()
            reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
            latencies.append(time.monotonic() - t0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.05)
        tokenized = future.result()
        took = time.monotonic() - started
    print(f"Tokenize of {TEXT_LIMIT} chars took {took:.2f}s; health max {max(latencies):.3f}s")
    assert len(tokenized.token_ids) > TEXT_LIMIT // 10
    assert len(latencies) >= 3, f"the Tokenize took only {took:.2f}s: nothing overlapped"
    assert max(latencies) < HEALTH_BOUND_S, (latencies, took)


def test_engine_failure_of_one_request_reaches_only_its_caller(served, monkeypatch):
    """A failure inside the engine (here: seeding) ends that call with its own status."""
    _, _, engine, _ = served
    real = engine.engine._generator

    def generator(seed: int) -> torch.Generator:
        if seed in (777, 778):
            raise OverflowError("injected: seed does not fit")
        return real(seed)

    monkeypatch.setattr(engine.engine, "_generator", generator)
    request = _generate(do_sample=True, seed=777, num_return_sequences=2)

    def hostile(stub):
        _refused(
            lambda: stub.Generate(request, timeout=60),
            grpc.StatusCode.INVALID_ARGUMENT,
            "failed in the engine while setting up its sequences",
        )

    _contained(served, hostile)


# -- engine level: one request's part of a batched step fails, the rest go on --------------------


@pytest.fixture(scope="module")
def model():
    _, ours, config = hf_reference("llama-gqa", seed=4, vocab_size=VOCAB)
    return ours, config


INNOCENT_CONFIGS = [
    SamplingConfig(max_new_tokens=12),
    SamplingConfig(max_new_tokens=12, do_sample=True, top_k=30, seed=5, num_return_sequences=2),
    SamplingConfig(max_new_tokens=10, num_beams=2, num_return_sequences=2),
]


def _innocent_prompts() -> list[list[int]]:
    return [prompt(5, VOCAB, seed=20 + i) for i in range(len(INNOCENT_CONFIGS))]


def _run_with(engine: Engine, hostile_prompt: list[int], hostile: SamplingConfig):
    """Innocent requests and one hostile one submitted together; (innocent results, hostile
    events)."""
    prompts = _innocent_prompts()
    ids = [engine.submit(p, c) for p, c in zip(prompts, INNOCENT_CONFIGS, strict=True)]
    bad = engine.submit(hostile_prompt, hostile)
    events: dict[int, list[StepEvent]] = {rid: [] for rid in [*ids, bad]}
    while engine.has_work():
        for event in engine.step():
            events[event.request_id].append(event)
    results = [
        [r.token_ids for r in collect(events[rid], c.num_return_sequences)]
        for rid, c in zip(ids, INNOCENT_CONFIGS, strict=True)
    ]
    return results, events[bad]


def _alone(model) -> list[list[list[int]]]:
    ours, _ = model
    engine = Engine(ours, TokenizerInfo(VOCAB))
    out = engine.generate(_innocent_prompts(), INNOCENT_CONFIGS)
    return [[r.token_ids for r in results] for results in out]


def _assert_failed_alone(hostile_events: list[StepEvent], stage: str) -> None:
    errors = [e.error for e in hostile_events if e.error is not None]
    assert len(errors) == 1 and isinstance(errors[0], RequestError), hostile_events
    assert stage in errors[0].stage
    assert hostile_events[-1].error is errors[0]  # nothing after its failure


def test_engine_seeding_failure_fails_one_request(model, monkeypatch):
    expected = _alone(model)
    engine = Engine(model[0], TokenizerInfo(VOCAB))
    real = engine._generator
    monkeypatch.setattr(
        engine, "_generator", lambda seed: real(seed) if seed < 900 else real(2**70)
    )
    results, bad = _run_with(
        engine, prompt(5, VOCAB, seed=30), SamplingConfig(do_sample=True, seed=900)
    )
    assert results == expected
    _assert_failed_alone(bad, "setting up")
    assert not engine.has_work() and engine.pool.num_rows == 0


def test_engine_prefill_failure_fails_one_request(model):
    """A forward that fails on the hostile prompt: the shared prefill retries per request."""
    expected = _alone(model)
    ours = model[0]
    engine = Engine(ours, TokenizerInfo(VOCAB))
    poison = 3
    real_forward = engine._last_logits

    def last_logits(ids_BS, view):
        if ids_BS.shape[1] > 1 and bool((ids_BS == poison).any()):
            raise RuntimeError("injected: forward failed on this batch")
        return real_forward(ids_BS, view)

    engine._last_logits = last_logits  # type: ignore[method-assign]
    step = engine.runner.decode_step
    if isinstance(step, NativeStep):  # a one-prompt chunk runs in the C step, not the forward
        real_verify = step.verify

        def verify(ids_S, view):
            if ids_S.shape[0] > 1 and bool((ids_S == poison).any()):
                raise RuntimeError("injected: the C step failed on this chunk")
            return real_verify(ids_S, view)

        step.verify = verify  # type: ignore[method-assign]
    hostile_prompt = [*prompt(4, VOCAB, seed=31), poison]  # same length: prefilled together
    results, bad = _run_with(engine, hostile_prompt, SamplingConfig(max_new_tokens=4))
    assert results == expected
    _assert_failed_alone(bad, "prefilling")
    assert engine.pool.num_rows == 0


def test_engine_decode_failure_fails_one_request(model):
    """A decode forward that fails whenever the hostile request's row is in the batch: the
    step retries row by row, the hostile request fails, the others decode on."""
    expected = _alone(model)
    engine = Engine(model[0], TokenizerInfo(VOCAB))
    hostile_id = len(INNOCENT_CONFIGS) + 1  # ids count from 1 in submission order
    real_decode = engine._decode_rows

    def decode_rows(ids_B1, start, stop, compiled=False):
        if any(row.request.request_id == hostile_id for row in engine._rows[start:stop]):
            raise RuntimeError("injected: decode failed with this row in the batch")
        return real_decode(ids_B1, start, stop, compiled)

    engine._decode_rows = decode_rows  # type: ignore[method-assign]
    results, bad = _run_with(engine, prompt(9, VOCAB, seed=35), SamplingConfig(max_new_tokens=6))
    assert bad[0].error is None  # its first token came from the prefill
    assert results == expected
    _assert_failed_alone(bad, "decoding")
    assert engine.pool.num_rows == 0


def test_engine_sampling_failure_keeps_other_generators_untouched(model, monkeypatch):
    """NaN logits in one sampled row: it fails before any row draws, seeded rows stay exact."""
    expected = _alone(model)
    engine = Engine(model[0], TokenizerInfo(VOCAB))
    real_warp = engine_module.warp

    def warp(logits_BV, configs, min_keep=1):
        out = real_warp(logits_BV, configs, min_keep)
        poisoned = torch.tensor([c.top_k == 7 for c in configs])
        return out.masked_fill(poisoned[:, None], float("nan"))

    monkeypatch.setattr(engine_module, "warp", warp)
    hostile = SamplingConfig(do_sample=True, top_k=7, seed=3, max_new_tokens=8)
    results, bad = _run_with(engine, prompt(6, VOCAB, seed=32), hostile)
    assert results == expected
    _assert_failed_alone(bad, "sampling")


def test_engine_stop_string_failure_fails_one_request(model, monkeypatch):
    expected = _alone(model)
    engine = Engine(model[0], TokenizerInfo(VOCAB))
    real_update = TextTracker.update

    def update(self, token_ids, final):
        if "boom" in self._stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_update(self, token_ids, final)

    monkeypatch.setattr(TextTracker, "update", update)
    hostile = SamplingConfig(max_new_tokens=8, stop=("boom",))
    results, bad = _run_with(engine, prompt(6, VOCAB, seed=33), hostile)
    assert results == expected
    _assert_failed_alone(bad, "detokenising")


def test_engine_beam_step_failure_fails_one_request(model, monkeypatch):
    expected = _alone(model)
    engine = Engine(model[0], TokenizerInfo(VOCAB))
    real_step = BeamSearch.step

    def step(self, logits, stop_check=None):
        if self.config.length_penalty == 3.5:
            raise IndexError("injected: beam bookkeeping")
        return real_step(self, logits, stop_check)

    monkeypatch.setattr(BeamSearch, "step", step)
    hostile = SamplingConfig(max_new_tokens=8, num_beams=3, length_penalty=3.5)
    results, bad = _run_with(engine, prompt(6, VOCAB, seed=34), hostile)
    assert results == expected
    _assert_failed_alone(bad, "beam-search")
    assert engine.pool.num_rows == 0
