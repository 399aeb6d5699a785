"""The real SmolLM2-135M-Instruct served by Meshline equals transformers on the same weights.

The GGUF dequantized by transformers (tests/fixtures/smollm2.py) is served through the
HF-loading path (gRPC and the OpenAI HTTP front on one engine). Its tokenizer is GPT-2-style and
adds no BOS: every front must encode a text as `AutoTokenizer.encode` does, and greedy answers
(text, and chat through the tokenizer's own template) must equal HF `generate` token for token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import requests
import torch

from meshline.inference.v1 import inference_pb2 as pb
from tests.services.inference.http_served import ServerHarness

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # building the dequantized model and loading it twice: ~1-2 min

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
)
CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a primary colour."},
    ],
)
NEW_TOKENS = 16
CONTEXT = 512
"""The served copy's max_position_embeddings: the dense KV cache is sized by it (8192 would
reserve ~6 GB for 8 rows, 512 about 0.4 GB); positions past the prompts here are never reached,
and the default RoPE does not depend on it, so outputs are those of the full model."""


@pytest.fixture(scope="module")
def smol(smollm2_dir, tmp_path_factory):
    """(served, HF model, HF tokenizer, checkpoint dir) for SmolLM2 with its own chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    served_dir = tmp_path_factory.mktemp("smollm2-served")
    for path in smollm2_dir.iterdir():
        if path.name != "config.json":
            (served_dir / path.name).symlink_to(path)
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (served_dir / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    harness = ServerHarness(served_dir, hf, hf.config, chat_template="auto")
    served = harness.start()
    yield served, hf, tokenizer, served_dir
    harness.close()


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    """HF's greedy new tokens (stopping at SmolLM2's EOS, `<|im_end|>`)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=hf.config.eos_token_id,
            pad_token_id=hf.config.eos_token_id,
            top_k=None,
            top_p=None,
            temperature=None,
            repetition_penalty=None,
        )
    return out[0, len(ids) :].tolist()


def _chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def test_every_front_encodes_as_the_hf_tokenizer(smol):
    served, _, tokenizer, _ = smol
    assert tokenizer.encode(PROMPTS[0]) == [504, 3575, 282, 4649, 314]  # no BOS
    for text in (*PROMPTS, "<|im_start|>user\nhi<|im_end|>"):
        expected = tokenizer.encode(text)
        got = requests.post(f"{served.http_url}/tokenize", json={"prompt": text}, timeout=30)
        assert got.json()["tokens"] == expected
        plain = requests.post(
            f"{served.http_url}/tokenize",
            json={"prompt": text, "add_special_tokens": False},
            timeout=30,
        )
        assert plain.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        grpc_ids = served.grpc_stub.Tokenize(pb.TokenizeRequest(text=text), timeout=30)
        assert list(grpc_ids.token_ids) == expected
        assert list(grpc_ids.tokens) == tokenizer.convert_ids_to_tokens(expected)
        completion = requests.post(
            f"{served.http_url}/v1/completions",
            json={
                "model": served.model_name, "prompt": text, "max_tokens": 0, "echo": True,
                "logprobs": 0, "temperature": 0,
            },
            timeout=60,
        ).json()  # fmt: skip
        assert completion["usage"]["prompt_tokens"] == len(expected)
        assert completion["choices"][0]["logprobs"]["tokens"] == tokenizer.convert_ids_to_tokens(
            expected
        )


def test_tokenizer_info_reports_the_real_special_tokens(smol):
    served, _, tokenizer, _ = smol
    info = requests.get(f"{served.http_url}/tokenizer_info", timeout=30).json()
    assert (
        (info["bos_token"], info["eos_token"], info["pad_token"])
        == (
            tokenizer.bos_token,
            tokenizer.eos_token,
            tokenizer.pad_token,
        )
        == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    )
    assert "<|im_start|>" in info["chat_template"]
    model_info = served.grpc_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (model_info.bos_token_id, model_info.eos_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )


def test_greedy_text_equals_hf_generate_over_grpc_and_http(smol):
    served, hf, tokenizer, _ = smol
    client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        expected = _hf_greedy(hf, tokenizer.encode(prompt))
        reply = served.grpc_stub.Generate(
            pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(max_new_tokens=NEW_TOKENS)),
            timeout=120,
        )
        assert list(reply.sequences[0].token_ids) == expected, prompt
        out = client.completions.create(
            model=served.model_name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
        )
        assert out.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert out.usage.completion_tokens == len(expected)


def test_greedy_chat_equals_hf_generate_through_the_chat_template(smol):
    served, hf, tokenizer, _ = smol
    client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0)
    for messages in CHATS:
        ids = _chat_ids(tokenizer, messages)
        expected = _hf_greedy(hf, ids)
        out = client.chat.completions.create(
            model=served.model_name, messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].message.content == tokenizer.decode(
            expected, skip_special_tokens=True
        )
        # gRPC has no messages: the template's text as a prompt encodes to the same ids.
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        reply = served.grpc_stub.Generate(
            pb.GenerateRequest(prompt=text, params=pb.SamplingParams(max_new_tokens=NEW_TOKENS)),
            timeout=120,
        )
        assert list(reply.sequences[0].token_ids) == expected


def test_meshline_generate_encodes_as_the_hf_tokenizer(smol, tmp_path):
    from services.inference.cli import main

    _, hf, tokenizer, served_dir = smol
    out = tmp_path / "out.json"
    argv = [
        "--load", str(served_dir), "--prompt", PROMPTS[0], "--max-new-tokens", str(NEW_TOKENS),
        "--output-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    ids = tokenizer.encode(PROMPTS[0])
    assert result["prompt_token_ids"] == ids
    assert result["sequences"][0]["token_ids"] == _hf_greedy(hf, ids)


LOGLIKELIHOOD = (
    ("The capital of France is", " Paris"),
    ("The capital of France is ", "Paris."),  # trailing space moves to the continuation
    ("", "Hello world"),  # empty context: lm-eval's prefix token (BOS, <|im_start|>) first
    ("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n", "4"),
    ("Question: Is water wet?\nAnswer:", " yes"),
    ("Question: Is water wet?\nAnswer:", " no"),
)
"""lm-eval loglikelihood requests covering its encoding rules (BOS-prefixed text included)."""


def _instances(kind: str, arguments) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def test_loglikelihoods_equal_lm_evals_hf_model(smol):
    """lm-eval's HFLM (default add_bos_token) is the reference for lm-eval's local-completions
    against the server and for Meshline's evaluator (gRPC and in-process)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from services.evaluator.models.grpc_client import GrpcLanguageModel
    from services.evaluator.models.local import LocalLanguageModel

    served, hf, tokenizer, served_dir = smol
    reference = HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=1, max_length=CONTEXT)
    expected = reference.loglikelihood(
        _instances("loglikelihood", LOGLIKELIHOOD), disable_tqdm=True
    )
    remote = LocalCompletionsAPI(
        base_url=f"{served.http_url}/v1/completions",
        model=served.model_name,
        tokenizer_backend="remote",  # /tokenize and /tokenizer_info of the server
        tokenized_requests=True,
        num_concurrent=1,
        max_retries=1,
        batch_size=2,
        max_length=CONTEXT,
    )
    grpc_model = GrpcLanguageModel(f"127.0.0.1:{served.grpc_port}", batch_size=4)
    local = LocalLanguageModel(served_dir, load_format="hf", batch_size=4)
    results = {
        "local-completions": remote.loglikelihood(_instances("loglikelihood", LOGLIKELIHOOD)),
        "meshline grpc": grpc_model.loglikelihood(list(LOGLIKELIHOOD)),
        "meshline local": local.loglikelihood(list(LOGLIKELIHOOD)),
    }
    for name, got in results.items():
        for request, (lp, greedy), (ref_lp, ref_greedy) in zip(
            LOGLIKELIHOOD, got, expected, strict=True
        ):
            assert lp == pytest.approx(ref_lp, abs=1e-3), (name, request)
            assert bool(greedy) == bool(ref_greedy), (name, request)

    # generate_until: the prompt is encoded as HFLM encodes it, so the answers are the same.
    from services.evaluator.models.base import GenerationRequest

    prompts = ("def add(a, b):\n", "The capital of France is")
    theirs = reference.generate_until(
        _instances(
            "generate_until",
            [
                (p, {"until": ["\n\n"], "max_gen_toks": NEW_TOKENS, "do_sample": False})
                for p in prompts
            ],
        ),
        disable_tqdm=True,
    )
    ours = grpc_model.generate_until([GenerationRequest(p, ("\n\n",), NEW_TOKENS) for p in prompts])
    assert ours == theirs
    grpc_model.close()
    local.close()


def test_humaneval_completions_equal_lm_evals_hf_model(smol, tmp_path):
    """The issue's case: HumanEval prompts encoded as lm-eval encodes them give HFLM's
    completions (greedy, `NEW_TOKENS` new tokens, lm-eval's stop strings)."""
    from lm_eval.models.huggingface import HFLM

    from services.evaluator.models.grpc_client import GrpcLanguageModel
    from services.evaluator.runner import EvalConfig, evaluate
    from services.evaluator.sandbox.runner import isolation
    from tests.services.evaluator.lm_eval_ref import FIXTURES

    served, hf, tokenizer, _ = smol
    model = GrpcLanguageModel(f"127.0.0.1:{served.grpc_port}", batch_size=4)
    config = EvalConfig(
        tasks=("humaneval",), task_data_path=FIXTURES, output_path=tmp_path, limit=3,
        max_new_tokens=NEW_TOKENS, allow_unsafe_code_execution=not isolation().available,
    )  # fmt: skip
    (outcome,) = evaluate(config, model)
    model.close()
    arguments = [tuple(args) for sample in outcome.samples for args in sample["arguments"]]
    ours = [resp for sample in outcome.samples for resp in sample["resps"]]
    assert len(ours) == len(outcome.samples) >= 2
    assert all(a[1]["max_gen_toks"] == NEW_TOKENS for a in arguments)
    reference = HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=1, max_length=CONTEXT)
    theirs = reference.generate_until(_instances("generate_until", arguments), disable_tqdm=True)
    assert ours == theirs
