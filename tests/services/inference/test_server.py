"""A real InferenceService on localhost serving a converted HF checkpoint, called over gRPC.

The server runs in a background event loop for the module (as `serve inference --load` would);
the tests use plain synchronous channels. Score is checked against log-softmax of the HF model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from meshline.common.v1 import checkpoint_pb2
from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from services.common.config import ServerConfig
from services.common.server import create_server
from services.inference.config import InferenceServiceConfig
from services.inference.servicer import bindings, load_engine
from tests.services.inference.helpers import hf_reference, prompt, save_hf_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    hf, _, config = hf_reference("llama-gqa", seed=2, vocab_size=512)
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"), sentencepiece_model)
    service_config = InferenceServiceConfig(load=directory, max_batch_rows=8)
    engine = load_engine(service_config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port, _ = asyncio.run_coroutine_threadsafe(
        create_server(bindings(service_config, engine), ServerConfig(host="127.0.0.1", port=0)),
        loop,
    ).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.InferenceServiceStub(channel), engine, hf, config
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    asyncio.run_coroutine_threadsafe(engine.front.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _params(**kwargs) -> pb.SamplingParams:
    return pb.SamplingParams(**kwargs)


def test_model_info(served):
    stub, engine, _, _ = served
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.family, info.vocab_size, info.context_length) == ("llama", 512, 128)
    assert info.dtype == "float32" and info.load_format == "hf" and info.device == "cpu"
    assert info.checkpoint_format == checkpoint_pb2.CHECKPOINT_FORMAT_HF
    assert info.eos_token_id == engine.tokens.eos_id and info.bos_token_id == engine.tokens.bos_id
    assert info.parallel_layout.tensor_parallel_size == 1
    assert info.task == pb.MODEL_TASK_GENERATE
    assert info.num_parameters == sum(p.numel() for p in engine.loaded.model.parameters())


def test_generate_text_and_tokens(served):
    stub, engine, _, _ = served
    tok = stub.Tokenize(pb.TokenizeRequest(text="The model", add_special_tokens=True), timeout=30)
    assert tok.token_ids[0] == engine.tokens.bos_id and len(tok.tokens) == len(tok.token_ids)
    by_text = stub.Generate(
        pb.GenerateRequest(prompt="The model", params=_params(max_new_tokens=12)), timeout=60
    )
    by_ids = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=tok.token_ids, params=_params(max_new_tokens=12)),
        timeout=60,
    )
    assert [s.token_ids for s in by_text.sequences] == [s.token_ids for s in by_ids.sequences]
    assert by_text.sequences[0].seed != by_ids.sequences[0].seed  # unset seed: server picks one
    [seq] = by_text.sequences
    assert len(seq.token_ids) == 12 and seq.finish_reason == pb.FINISH_REASON_LENGTH
    detok = stub.Detokenize(
        pb.DetokenizeRequest(token_ids=seq.token_ids, skip_special_tokens=True), timeout=30
    )
    assert detok.text == seq.text


def test_stream_equals_generate(served):
    stub, _, _, _ = served
    request = pb.GenerateRequest(
        prompt_token_ids=prompt(6, 512, seed=3),
        params=_params(max_new_tokens=10, do_sample=True, top_k=20, seed=9, num_return_sequences=2),
    )
    whole = stub.Generate(request, timeout=60)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finals = {}
    for message in stub.GenerateStream(request, timeout=60):
        tokens[message.index] += list(message.token_ids)
        assert message.seed == 9 + message.index
        if message.finish_reason:
            finals[message.index] = message
    assert [tokens[0], tokens[1]] == [list(s.token_ids) for s in whole.sequences]
    for i, seq in enumerate(whole.sequences):
        assert finals[i].cumulative_logprob == pytest.approx(seq.cumulative_logprob, abs=1e-4)


def test_concurrent_requests_match_sequential(served):
    stub, _, _, _ = served
    requests = [
        pb.GenerateRequest(
            prompt_token_ids=prompt(3 + i, 512, seed=i), params=_params(max_new_tokens=6 + i)
        )
        for i in range(6)
    ]
    requests.append(
        pb.GenerateRequest(
            prompt_token_ids=prompt(5, 512, seed=7),
            params=_params(max_new_tokens=6, num_beams=3, num_return_sequences=2),
        )
    )
    sequential = [stub.Generate(r, timeout=60) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        concurrent = list(pool.map(lambda r: stub.Generate(r, timeout=60), requests))
    for a, b in zip(sequential, concurrent, strict=True):
        assert [list(s.token_ids) for s in a.sequences] == [list(s.token_ids) for s in b.sequences]


def test_cancelled_stream_stops_the_engine(served):
    stub, engine, _, _ = served
    request = pb.GenerateRequest(
        prompt_token_ids=prompt(4, 512, seed=5), params=_params(max_new_tokens=100)
    )
    call = stub.GenerateStream(request, timeout=60)
    for _ in range(3):
        next(call)
    call.cancel()
    deadline = time.monotonic() + 20
    while engine.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.engine.has_work()
    request_id = max(engine.engine.tokens_computed)
    computed = engine.engine.tokens_computed[request_id]
    time.sleep(0.5)
    assert engine.engine.tokens_computed[request_id] == computed
    assert computed < 4 + 99  # far from the full 100 tokens


def test_score_matches_hf_log_softmax(served):
    stub, engine, hf, _ = served
    contexts = [prompt(n, 512, seed=n) for n in (3, 8, 5)]
    continuations = [prompt(n, 512, seed=10 + n) for n in (4, 2, 6)]
    with torch.no_grad():
        greedy = hf.generate(
            torch.tensor([contexts[0]]),
            max_new_tokens=3,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )[0, 3:].tolist()
    contexts.append(contexts[0])
    continuations.append(greedy)
    items = [
        pb.ScoreItem(context_token_ids=c, continuation_token_ids=x)
        for c, x in zip(contexts, continuations, strict=True)
    ]
    items.append(pb.ScoreItem(continuation="The model"))
    response = stub.Score(pb.ScoreRequest(items=items), timeout=60)
    for ctx, cont, result in zip(contexts, continuations, response.results, strict=False):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].float(), -1)
        rows = logp[len(ctx) - 1 : len(ctx) - 1 + len(cont)]
        expected = rows.gather(1, torch.tensor(cont)[:, None])[:, 0]
        assert list(result.token_logprobs) == pytest.approx(expected.tolist(), abs=1e-4)
        assert result.logprob == pytest.approx(expected.sum().item(), abs=1e-4)
        assert result.is_greedy == bool((rows.argmax(-1) == torch.tensor(cont)).all())
    assert response.results[3].is_greedy and not response.results[0].is_greedy
    bos_scored = response.results[4]
    assert len(bos_scored.token_logprobs) == len(engine.tokens.require().encode("The model"))


@pytest.mark.parametrize(
    "request_, code, named",
    [
        (
            pb.GenerateRequest(prompt_token_ids=[5, 600], params=_params(max_new_tokens=2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt_token_ids",
        ),
        (
            pb.GenerateRequest(prompt_token_ids=[5] * 100, params=_params(max_new_tokens=40)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "params.max_new_tokens",
        ),
        (
            pb.GenerateRequest(prompt="hi", params=_params(temperature=2.5, do_sample=True)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "params.temperature",
        ),
        (
            pb.GenerateRequest(prompt="hi", params=_params(num_beams=12)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "params.num_beams",
        ),
        (
            pb.GenerateRequest(prompt="hi", params=_params(top_k=-1, top_p=0.0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "params.top_p",
        ),
    ],
)
def test_invalid_generate_requests(served, request_, code, named):
    stub, _, _, _ = served
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request_, timeout=30)
    assert caught.value.code() == code, caught.value.details()
    assert named in caught.value.details()


def test_invalid_score_requests(served):
    stub, _, _, _ = served
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(
            pb.ScoreRequest(
                items=[pb.ScoreItem(context_token_ids=[3], continuation_token_ids=[999])]
            ),
            timeout=30,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0]" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(
            pb.ScoreRequest(
                items=[pb.ScoreItem(context_token_ids=[3] * 120, continuation_token_ids=[4] * 10)]
            ),
            timeout=30,
        )
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
