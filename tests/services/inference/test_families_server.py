"""A real InferenceService on localhost (`serve inference --load DIR --load-format hf`) serving
issue #18 checkpoints written by transformers' `save_pretrained` — Mistral (sliding window),
Qwen3 (q/k norm, head_dim) and Qwen2-MoE (shared expert) — over gRPC: greedy and 3-beam tokens on
a prompt longer than the window equal HF `generate`, and Score (the evaluator's loglikelihood
RPC) equals HF's log-softmax."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from services.common.config import ServerConfig
from services.common.server import create_server
from services.inference.config import InferenceServiceConfig
from services.inference.servicer import bindings, load_engine
from tests.models.test_families import FAMILIES, hf_model
from tests.services.inference.helpers import hf_generate, prompt

PROMPT = 24


@pytest.fixture(scope="module", params=["mistral", "qwen3", "qwen2_moe"])
def served(request, tmp_path_factory):
    hf = hf_model(FAMILIES[request.param], seed=7)
    directory = tmp_path_factory.mktemp("ckpt") / request.param
    hf.save_pretrained(directory)
    service_config = InferenceServiceConfig(load=directory, load_format="hf", max_batch_rows=8)
    engine = load_engine(service_config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port, _ = asyncio.run_coroutine_threadsafe(
        create_server(bindings(service_config, engine), ServerConfig(host="127.0.0.1", port=0)),
        loop,
    ).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.InferenceServiceStub(channel), engine, hf
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    asyncio.run_coroutine_threadsafe(engine.front.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_greedy_and_beam_over_grpc_equal_hf_generate(served):
    stub, engine, hf = served
    ids = prompt(PROMPT, 256, seed=5)
    eos = engine.tokens.eos_id
    expected = hf_generate(hf, ids, max_new_tokens=10, eos_token_id=eos)
    reply = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=ids, params=pb.SamplingParams(max_new_tokens=10)),
        timeout=120,
    )
    assert list(reply.sequences[0].token_ids) == expected[0, PROMPT:].tolist()
    beams = pb.SamplingParams(max_new_tokens=6, num_beams=3, num_return_sequences=3)
    expected = hf_generate(
        hf, ids, max_new_tokens=6, num_beams=3, num_return_sequences=3, eos_token_id=eos
    )
    reply = stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, params=beams), timeout=120)
    got = [list(s.token_ids) for s in reply.sequences]
    want = [row[PROMPT:].tolist() for row in expected]
    assert got == [w[: len(g)] for w, g in zip(want, got, strict=True)] and all(got)


def test_score_over_grpc_equals_hf_log_softmax(served):
    """Score, the RPC the evaluator's loglikelihood tasks use, on contexts longer than the
    sliding window: per-token log-probabilities equal HF's log-softmax."""
    stub, _, hf = served
    contexts = [prompt(n, 256, seed=n) for n in (20, 11)]
    continuations = [prompt(n, 256, seed=30 + n) for n in (6, 3)]
    items = [
        pb.ScoreItem(context_token_ids=c, continuation_token_ids=x)
        for c, x in zip(contexts, continuations, strict=True)
    ]
    response = stub.Score(pb.ScoreRequest(items=items), timeout=120)
    for ctx, cont, result in zip(contexts, continuations, response.results, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].float(), -1)
        rows = logp[len(ctx) - 1 : len(ctx) - 1 + len(cont)]
        expected = rows.gather(1, torch.tensor(cont)[:, None])[:, 0]
        assert list(result.token_logprobs) == pytest.approx(expected.tolist(), abs=1e-4)
