"""The HTTP front's auth, limits and cancellation, and top-k log-probabilities over gRPC."""

from __future__ import annotations

import json
import time

import pytest
import requests
import torch

from meshline.inference.v1 import inference_pb2 as pb
from services.common.config import ServerConfig
from tests.services.inference.http_served import ServerHarness, make_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=5)
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text("s3cret\n")
    harness = ServerHarness(directory, hf, config, max_request_mb=0.001, max_concurrent_requests=1)
    yield harness.start(ServerConfig(host="127.0.0.1", port=0, auth_token_file=str(token_file)))
    harness.close()


AUTH = {"Authorization": "Bearer s3cret"}


def test_auth_required_except_health(served):
    url = f"{served.http_url}/v1/models"
    assert requests.get(url, timeout=10).status_code == 401
    wrong = requests.get(url, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(url, headers=AUTH, timeout=10).status_code == 200
    assert requests.get(f"{served.http_url}/health", timeout=10).status_code == 200


def test_body_over_limit_is_413(served):
    body = {"model": served.model_name, "prompt": "x" * 5000, "max_tokens": 1}
    response = requests.post(
        f"{served.http_url}/v1/completions", json=body, headers=AUTH, timeout=10
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = requests.post(
        f"{served.http_url}/v1/completions",
        data=(b"x" * 512 for _ in range(8)),  # no Content-Length: Transfer-Encoding chunked
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=10,
    )
    assert chunked.status_code == 413, chunked.text


def _stream_request(served, max_tokens: int) -> requests.Response:
    body = {
        "model": served.model_name,
        "prompt": [5, 6, 7],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "stream": True,
    }
    return requests.post(
        f"{served.http_url}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60
    )


def test_concurrency_limit_is_429_and_disconnect_cancels(served):
    stream = _stream_request(served, 100)
    lines = stream.iter_lines()
    first = next(line for line in lines if line)
    assert json.loads(first.removeprefix(b"data: "))["choices"]
    busy = requests.get(f"{served.http_url}/v1/models", headers=AUTH, timeout=10)
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
    stream.close()  # the client goes away mid-generation
    deadline = time.monotonic() + 20
    while served.engine.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not served.engine.engine.has_work()
    assert served.engine.engine.tokens_computed  # it did run
    assert requests.get(f"{served.http_url}/v1/models", headers=AUTH, timeout=10).ok


def test_grpc_generate_and_score_report_top_k(served):
    metadata = (("authorization", "Bearer s3cret"),)
    ids = [1, 40, 77, 9]
    out = served.grpc_stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=ids, params=pb.SamplingParams(max_new_tokens=4, logprobs=3)
        ),
        timeout=60,
        metadata=metadata,
    )
    [seq] = out.sequences
    assert len(seq.token_logprobs) == len(seq.top_logprobs) == 4
    with torch.no_grad():
        reference = torch.log_softmax(
            served.hf(torch.tensor([ids + list(seq.token_ids)])).logits[0].float(), -1
        )
    for t, (lp, top) in enumerate(zip(seq.token_logprobs, seq.top_logprobs, strict=True)):
        row = reference[len(ids) - 1 + t]
        assert lp == pytest.approx(float(row[seq.token_ids[t]]), abs=1e-4)
        values, top_ids = row.topk(3)
        assert [c.token_id for c in top.candidates] == top_ids.tolist()
        assert [c.logprob for c in top.candidates] == pytest.approx(values.tolist(), abs=1e-4)
        assert top.candidates[0].token_id == seq.token_ids[t]  # greedy
    request = pb.GenerateRequest(
        prompt_token_ids=ids, params=pb.SamplingParams(max_new_tokens=4, logprobs=3)
    )
    messages = list(served.grpc_stub.GenerateStream(request, timeout=60, metadata=metadata))
    streamed = [lp for m in messages for lp in m.token_logprobs]
    assert streamed == pytest.approx(list(seq.token_logprobs), abs=1e-6)
    assert [t for m in messages for t in m.top_logprobs] == list(seq.top_logprobs)
    worst = int(reference[len(ids) - 1].argmin())
    scored = served.grpc_stub.Score(
        pb.ScoreRequest(
            items=[
                pb.ScoreItem(context_token_ids=ids, continuation_token_ids=list(seq.token_ids)),
                pb.ScoreItem(context_token_ids=ids, continuation_token_ids=[worst]),
            ],
            top_logprobs=2,
        ),
        timeout=60,
        metadata=metadata,
    )
    greedy, other = scored.results
    assert greedy.is_greedy and not other.is_greedy
    assert len(greedy.top_logprobs) == 4 and len(other.top_logprobs[0].candidates) == 2
    assert greedy.top_logprobs[0].candidates[0].token_id == seq.token_ids[0]
    assert other.top_logprobs[0].candidates[0].logprob > other.token_logprobs[0]
    bad = pb.GenerateRequest(
        prompt_token_ids=ids, params=pb.SamplingParams(logprobs=3, num_beams=2)
    )
    with pytest.raises(Exception, match="logprobs"):
        served.grpc_stub.Generate(bad, timeout=30, metadata=metadata)


def test_https_with_the_servers_tls_files_and_mtls(tmp_path_factory, sentencepiece_model):
    from tests.services.common.helpers import make_pki

    certs = make_pki(tmp_path_factory.mktemp("pki"))
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=5)
    harness = ServerHarness(directory, hf, config)
    try:
        served = harness.start(
            ServerConfig(
                host="127.0.0.1",
                port=0,
                tls_cert=str(certs.server_cert),
                tls_key=str(certs.server_key),
                tls_client_ca=str(certs.ca),
            )
        )
        assert served.http_url.startswith("https://")
        url = f"{served.http_url}/v1/models"
        client = (str(certs.client_cert), str(certs.client_key))
        response = requests.get(url, verify=str(certs.ca), cert=client, timeout=10)
        assert response.json()["data"][0]["id"] == served.model_name
        with pytest.raises(requests.exceptions.RequestException):
            requests.get(url, verify=str(certs.ca), timeout=10)  # no client certificate
        rogue = (str(certs.rogue_cert), str(certs.rogue_key))
        with pytest.raises(requests.exceptions.RequestException):
            requests.get(url, verify=str(certs.ca), cert=rogue, timeout=10)
    finally:
        harness.close()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_auto_chat_template_renders_like_transformers(tmp_path_factory, hf_tokenizer_dir):
    import shutil

    from transformers import AutoTokenizer

    from tests.services.inference.helpers import hf_generate, hf_reference, save_hf_checkpoint

    tokenizer_dir = tmp_path_factory.mktemp("tok") / "tokenizer"
    shutil.copytree(hf_tokenizer_dir, tokenizer_dir)
    config_file = tokenizer_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(tokenizer_config))
    hf, _, config = hf_reference("llama-gqa", seed=9, vocab_size=512)
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"))
    harness = ServerHarness(directory, hf, config, tokenizer=tokenizer_dir, chat_template="auto")
    try:
        served = harness.start()
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = reference(text, add_special_tokens=False)["input_ids"]
        body = {"model": served.model_name, "messages": messages, "max_tokens": 5, "temperature": 0}
        out = requests.post(f"{served.http_url}/v1/chat/completions", json=body, timeout=60)
        assert out.status_code == 200, out.text
        answer = out.json()
        assert answer["usage"]["prompt_tokens"] == len(ids)
        eos = served.engine.tokens.eos_id
        expected = hf_generate(hf, ids, max_new_tokens=5, eos_token_id=eos)[0, len(ids) :].tolist()
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert answer["choices"][0]["message"]["content"] == served.engine.tokens.decode(expected)
        info = requests.get(f"{served.http_url}/tokenizer_info", timeout=10).json()
        assert info["chat_template"] == CHAT_TEMPLATE
    finally:
        harness.close()


def test_plain_request_is_cancelled_when_its_client_disconnects(served, monkeypatch):
    import socket

    from prometheus_client import REGISTRY

    from services.inference import http_streaming

    monkeypatch.setattr(http_streaming, "DISCONNECT_POLL_S", 0.01)
    labels = {"protocol": "http", "finish_reason": "cancelled"}

    def cancelled() -> float:
        return REGISTRY.get_sample_value("meshline_inference_requests_total", labels) or 0.0

    before = cancelled()
    body = json.dumps(
        {"model": served.model_name, "prompt": [5, 6, 7], "max_tokens": 120, "temperature": 1.0}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer s3cret\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    port = int(served.http_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(head + body)
        deadline = time.monotonic() + 20
        while not served.engine.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert served.engine.engine.has_work()
    deadline = time.monotonic() + 20
    while served.engine.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not served.engine.engine.has_work()
    # Counted when the request's stream closes on the server's event loop, which need not
    # come before the engine drops the row: wait for the count, then check it exactly.
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cancelled() - before == 1
