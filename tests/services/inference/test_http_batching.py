"""Concurrent OpenAI HTTP requests decode as one batch on the shared engine (issue #21).

The engine thread is held while a batch of plain `/v1/completions` requests arrive, each from
its own client thread; every one of them must reach the engine (nothing on the HTTP path may
serialise them or cap how many are open), and once released they must decode together — one
step with every row — and answer what each prompt answers alone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.services.inference.http_served import ServerHarness, make_checkpoint

BATCH = 8
"""The harness's --max-batch-rows."""
NEW_TOKENS = 6
WAIT_S = 60.0


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model)
    harness = ServerHarness(directory, hf, config)
    yield harness.start()
    harness.close()


def _complete(url: str, prompt: list[int]) -> list[str]:
    """The greedy tokens (as the answer's logprobs name them) of one plain completion."""
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0}
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=WAIT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]["tokens"]


def test_concurrent_http_requests_decode_as_one_batch(served, monkeypatch):
    engine = served.engine.engine
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i] for i in range(BATCH)]
    alone = [_complete(served.http_url, p) for p in prompts]

    submitted = []
    submit = engine.submit

    def counting_submit(prompt_ids, config, adapter=""):
        submitted.append(list(prompt_ids))
        return submit(prompt_ids, config, adapter)

    rows_per_step: list[int] = []
    observe = engine.on_step

    def recording_step(e):
        rows_per_step.append(e.load()[0])
        if observe is not None:
            observe(e)

    monkeypatch.setattr(engine, "submit", counting_submit)
    monkeypatch.setattr(engine, "on_step", recording_step)
    gate = threading.Event()
    held = served.engine.worker.call(gate.wait)  # the engine thread waits here
    try:
        with ThreadPoolExecutor(max_workers=BATCH) as pool:
            replies = [pool.submit(_complete, served.http_url, p) for p in prompts]
            deadline = time.monotonic() + WAIT_S
            while len(submitted) < BATCH and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(submitted) == BATCH, f"only {len(submitted)} of {BATCH} reached the engine"
            gate.set()
            together = [r.result(WAIT_S) for r in replies]
    finally:
        gate.set()
        held.result(WAIT_S)
    assert together == alone
    assert rows_per_step[0] == BATCH
    assert len(rows_per_step) <= NEW_TOKENS


def test_prompt_tokenising_leaves_the_event_loop_free(served, monkeypatch):
    """A text prompt is tokenised in a worker thread (as on the gRPC front): while one request's
    tokenising is held, the same event loop still answers /health."""
    tokens = served.engine.tokens
    encode = tokens.encode_prompt
    started, release = threading.Event(), threading.Event()

    def held_encode(text, add_special_tokens=True):
        started.set()
        release.wait(WAIT_S)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokens, "encode_prompt", held_encode)
    body = {"prompt": "hello there", "max_tokens": 2, "temperature": 0}
    with ThreadPoolExecutor(max_workers=1) as pool:
        reply = pool.submit(
            requests.post, f"{served.http_url}/v1/completions", json=body, timeout=WAIT_S
        )
        try:
            assert started.wait(WAIT_S), "the completion never reached the tokenizer"
            health = requests.get(f"{served.http_url}/health", timeout=10)
            assert health.status_code == 200
        finally:
            release.set()
        assert reply.result(WAIT_S).status_code == 200
