"""Every serving front encodes as `AutoTokenizer.from_pretrained(dir)` for each tokenizer convention.

A tiny random Llama is served with each tokenizer of tests/fixtures/tokenizer_conventions.py
(Qwen2.5-style BPE without BOS, Llama-3-style BPE with `<|begin_of_text|>`, sentencepiece with
and without `add_bos_token`): HTTP `/tokenize` and `/v1/completions`, gRPC `Tokenize` and
`Generate`, and `meshline generate` must give the HF tokenizer's default ids (and its
`add_special_tokens=False` ids where the request asks for them).
"""

from __future__ import annotations

import json

import pytest
import requests

from meshline.inference.v1 import inference_pb2 as pb
from tests.fixtures.tokenizer_conventions import CONVENTIONS, SAMPLE_TEXTS, build_convention
from tests.services.inference.helpers import hf_generate, hf_reference, save_hf_checkpoint
from tests.services.inference.http_served import ServerHarness

TEXTS = [t for t in SAMPLE_TEXTS if t]


@pytest.fixture(scope="module", params=CONVENTIONS)
def served(request, tmp_path_factory):
    """(served, HF tokenizer, checkpoint dir, tokenizer dir) per convention."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(request.param)
    tokenizer_dir = build_convention(request.param, root / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hf, _, config = hf_reference("llama-gqa", seed=3, vocab_size=len(tokenizer))
    checkpoint = save_hf_checkpoint(hf, root / "checkpoint")
    harness = ServerHarness(checkpoint, hf, config, tokenizer=tokenizer_dir)
    yield harness.start(), tokenizer, checkpoint, tokenizer_dir
    harness.close()


def _post(served, path: str, body: dict) -> dict:
    reply = requests.post(f"{served.http_url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_http_tokenize_and_completions(served):
    server, tokenizer, _, _ = served
    for text in TEXTS:
        expected = tokenizer.encode(text)
        plain = tokenizer.encode(text, add_special_tokens=False)
        assert _post(server, "/tokenize", {"prompt": text})["tokens"] == expected
        got = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        assert got == plain
        body = {
            "model": server.model_name, "prompt": text, "max_tokens": 0, "echo": True,
            "logprobs": 0, "temperature": 0,
        }  # fmt: skip
        completion = _post(server, "/v1/completions", body)
        assert completion["usage"]["prompt_tokens"] == len(expected), text
        echoed = completion["choices"][0]["logprobs"]["tokens"]
        assert echoed == tokenizer.convert_ids_to_tokens(expected), text
        alone = _post(server, "/v1/completions", {**body, "add_special_tokens": False})
        assert alone["usage"]["prompt_tokens"] == len(plain), text


def test_grpc_tokenize_and_generate(served):
    server, tokenizer, _, _ = served
    for text in TEXTS:
        expected = tokenizer.encode(text)
        reply = server.grpc_stub.Tokenize(pb.TokenizeRequest(text=text), timeout=30)
        assert list(reply.token_ids) == expected, text
        assert list(reply.tokens) == tokenizer.convert_ids_to_tokens(expected)
        plain = server.grpc_stub.Tokenize(
            pb.TokenizeRequest(text=text, add_special_tokens=False), timeout=30
        )
        assert list(plain.token_ids) == tokenizer.encode(text, add_special_tokens=False)
    for text in TEXTS[:3]:
        ids = tokenizer.encode(text)
        reply = server.grpc_stub.Generate(
            pb.GenerateRequest(prompt=text, params=pb.SamplingParams(max_new_tokens=4)),
            timeout=60,
        )
        eos = tokenizer.eos_token_id
        expected = hf_generate(server.hf, ids, max_new_tokens=4, eos_token_id=eos, pad_token_id=eos)
        assert list(reply.sequences[0].token_ids) == expected[0, len(ids) :].tolist(), text
    # add_special_tokens=false (vLLM's field): the text's ids without the tokenizer's framing.
    text = TEXTS[0]
    plain = tokenizer.encode(text, add_special_tokens=False)
    reply = server.grpc_stub.Generate(
        pb.GenerateRequest(
            prompt=text, add_special_tokens=False, params=pb.SamplingParams(max_new_tokens=4)
        ),
        timeout=60,
    )
    eos = tokenizer.eos_token_id
    expected = hf_generate(server.hf, plain, max_new_tokens=4, eos_token_id=eos, pad_token_id=eos)
    assert list(reply.sequences[0].token_ids) == expected[0, len(plain) :].tolist(), text


def test_tokenizer_info_names_the_tokenizers_special_tokens(served):
    server, tokenizer, _, _ = served
    info = requests.get(f"{server.http_url}/tokenizer_info", timeout=30).json()
    assert info["bos_token"] == tokenizer.bos_token
    assert info["eos_token"] == tokenizer.eos_token


def test_meshline_generate_prompt(served, tmp_path):
    from services.inference.cli import main

    _, tokenizer, checkpoint, tokenizer_dir = served
    out = tmp_path / "out.json"
    argv = [
        "--load", str(checkpoint), "--tokenizer", str(tokenizer_dir), "--prompt", TEXTS[0],
        "--max-new-tokens", "2", "--output-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["prompt_token_ids"] == tokenizer.encode(TEXTS[0])
