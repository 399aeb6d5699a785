"""A reward model served by the inference service: the Reward RPC and vLLM's POST /pooling.

The served checkpoint is a HF `LlamaForSequenceClassification` (one label) with random weights
and the fixture tokenizer; every reward must equal transformers'
`AutoModelForSequenceClassification` logits on the same ids. Generation on a reward model and
rewards from a causal LM are refused by name.
"""

from __future__ import annotations

import grpc
import pytest
import requests
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig
from transformers import LlamaForSequenceClassification as HFRewardModel

from meshline.inference.v1 import inference_pb2 as pb
from meshline_client.connection import Connection
from meshline_client.inference import InferenceClient
from models.hf_adapters import hf_config
from models.registry import get_config
from models.templates import TEMPLATES, Message
from services.common.config import ServerConfig
from services.inference.config import InferenceServiceConfig
from services.inference.reward_serving import build_serving_reward_model
from tests.services.inference.helpers import save_hf_checkpoint
from tests.services.inference.http_served import ServerHarness, make_checkpoint

PAD = 3  # the fixture tokenizer's pad id
TEXTS = ["the cat sat on the mat", "a longer sentence about dogs and cats and birds", "hello"]


def make_reward_checkpoint(directory, sentencepiece_model, seed: int = 5):
    """A tiny HF reward model (LlamaForSequenceClassification, one label) saved in `directory`."""
    config = get_config("tiny-llama-gqa", vocab_size=512)
    hf_cfg = LlamaConfig(**hf_config(config), num_labels=1, pad_token_id=PAD)
    hf_cfg.architectures = ["LlamaForSequenceClassification"]
    hf = HFRewardModel._from_config(hf_cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return save_hf_checkpoint(hf.eval(), directory, sentencepiece_model)


def hf_rewards(directory, rows: list[list[int]]) -> list[float]:
    """transformers' scores of each row alone (no padding)."""
    hf = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        return [float(hf(input_ids=torch.tensor([row])).logits[0, 0]) for row in rows]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, sentencepiece_model):
    return make_reward_checkpoint(tmp_path_factory.mktemp("rm"), sentencepiece_model)


@pytest.fixture(scope="module")
def served(reward_dir):
    harness = ServerHarness(reward_dir, None, None, limits=InferenceServiceConfig(load=reward_dir))
    yield harness.start()
    harness.close()


def _rows(served, texts):
    return [served.engine.tokens.encode_prompt(t) for t in texts]


def test_grpc_rewards_equal_transformers(served, reward_dir):
    rows = _rows(served, TEXTS)
    inputs = [pb.RewardInput(text=TEXTS[0]), pb.RewardInput(token_ids=rows[1])]
    inputs.append(pb.RewardInput(text=TEXTS[2]))
    reply = served.grpc_stub.Reward(pb.RewardRequest(inputs=inputs))
    expected = hf_rewards(reward_dir, rows)
    assert list(reply.num_tokens) == [len(r) for r in rows]
    assert max(abs(a - b) for a, b in zip(reply.rewards, expected, strict=True)) <= 1e-5
    assert len(set(round(r, 4) for r in reply.rewards)) == 3  # each input's own last token


def test_pooling_route_equals_transformers(served, reward_dir):
    rows = _rows(served, TEXTS)
    body = requests.post(f"{served.http_url}/pooling", json={"input": TEXTS}, timeout=30).json()
    assert body["object"] == "list" and body["model"] == served.model_name
    got = [item["data"][0] for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert max(abs(a - b) for a, b in zip(got, hf_rewards(reward_dir, rows), strict=True)) <= 1e-5
    assert body["usage"]["prompt_tokens"] == sum(len(r) for r in rows)
    # One id list, and a conversation rendered with the front's chat template (chatml here).
    one = requests.post(f"{served.http_url}/pooling", json={"input": rows[1]}, timeout=30).json()
    assert one["data"][0]["data"][0] == pytest.approx(got[1], abs=1e-6)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat = requests.post(f"{served.http_url}/pooling", json={"messages": messages}, timeout=30)
    text = "".join(s.text for s in TEMPLATES["chatml"].render([Message(**m) for m in messages]))
    expected = hf_rewards(reward_dir, [served.engine.tokens.encode_prompt(text)])[0]
    assert chat.json()["data"][0]["data"][0] == pytest.approx(expected, abs=1e-5)


def test_reward_model_refuses_generation(served):
    with pytest.raises(grpc.RpcError) as err:
        served.grpc_stub.Generate(pb.GenerateRequest(prompt="hello"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is a reward model" in err.value.details()
    reply = requests.post(
        f"{served.http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "model" and "reward model" in error["message"]
    info = served.grpc_stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.family == "llama" and info.vocab_size == 512
    assert info.task == pb.MODEL_TASK_REWARD
    models = requests.get(f"{served.http_url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [served.model_name]
    assert models[0]["max_model_len"] == info.context_length
    assert requests.get(f"{served.http_url}/health", timeout=30).status_code == 200


def test_reward_request_validation(served):
    cases = [
        (pb.RewardRequest(), "inputs"),
        (pb.RewardRequest(inputs=[pb.RewardInput(text="a", token_ids=[5])]), "inputs[0]"),
        (pb.RewardRequest(inputs=[pb.RewardInput(token_ids=[5, 512])]), "inputs[0]"),
        (pb.RewardRequest(inputs=[pb.RewardInput(token_ids=[5] * 5000)]), "inputs[0]"),
        (pb.RewardRequest(inputs=[pb.RewardInput(token_ids=[5])] * 1025), "inputs"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            served.grpc_stub.Reward(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert f"{field}:" in err.value.details()
    for body, param in (
        ({"input": "a", "messages": [{"role": "user", "content": "x"}]}, "body"),
        ({"input": [[5, 600]]}, "input"),
        ({"input": ""}, "input[0]"),
        ({"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ({"input": "a", "model": "other"}, "model"),
    ):
        reply = requests.post(f"{served.http_url}/pooling", json=body, timeout=30)
        assert reply.status_code in (400, 404), body
        assert reply.json()["error"]["param"] == param, reply.json()


def test_causal_lm_refuses_rewards(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model)
    harness = ServerHarness(directory, hf, config)
    served = harness.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            served.grpc_stub.Reward(pb.RewardRequest(inputs=[pb.RewardInput(text="hi")]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is a causal LM, not a reward model" in err.value.details()
        reply = requests.post(f"{served.http_url}/pooling", json={"input": "hi"}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
    finally:
        harness.close()


def test_generation_flags_refused_for_a_reward_model(reward_dir):
    for limits, flag in (
        (InferenceServiceConfig(load=reward_dir, max_batch_rows=8), "--max-batch-rows"),
        (InferenceServiceConfig(load=reward_dir, enable_lora=True), "--enable-lora"),
        (InferenceServiceConfig(load=reward_dir, tensor_parallel_size=2), "--tensor-parallel"),
    ):
        with pytest.raises(ValueError, match=f"{flag}.*is a reward model"):
            build_serving_reward_model(limits)


def test_reward_rpc_and_route_are_authenticated(reward_dir, tmp_path):
    """With --auth-token-file, Reward and /pooling need the token; meshline_client sends it."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    harness = ServerHarness(reward_dir, None, None, limits=InferenceServiceConfig(load=reward_dir))
    served = harness.start(ServerConfig(host="127.0.0.1", port=0, auth_token_file=str(token_file)))
    try:
        with pytest.raises(grpc.RpcError) as err:
            served.grpc_stub.Reward(pb.RewardRequest(inputs=[pb.RewardInput(text="hi")]))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = requests.post(f"{served.http_url}/pooling", json={"input": "hi"}, timeout=30)
        assert reply.status_code == 401
        address = f"127.0.0.1:{served.grpc_port}"
        with InferenceClient(Connection(address, token="s3cret")) as client:
            got = client.reward(["hi", served.engine.tokens.encode_prompt("hi")])
        assert (
            got[0]
            == got[1]
            == pytest.approx(hf_rewards(reward_dir, _rows(served, ["hi"]))[0], abs=1e-5)
        )
        reply = requests.post(
            f"{served.http_url}/pooling",
            json={"input": "hi"},
            headers={"Authorization": "Bearer s3cret"},
            timeout=30,
        )
        assert reply.json()["data"][0]["data"][0] == pytest.approx(got[0], abs=1e-6)
    finally:
        harness.close()


def test_commands_refuse_a_reward_model_where_it_cannot_serve(reward_dir, capsys):
    """`meshline generate` names the serving command; `meshline serve inference` with a
    generation-only flag exits 2 naming the flag, before any weight is read."""
    from services.inference.__main__ import main as serve_main
    from services.inference.cli import main as generate_main

    assert generate_main(["--load", str(reward_dir), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "a reward model" in err and "meshline serve inference" in err
    argv = ["serve", "--load", str(reward_dir), "--port", "0", "--max-batch-rows", "4"]
    assert serve_main(argv) == 2
    assert "--max-batch-rows: --load" in capsys.readouterr().err


def test_reward_without_a_model_is_failed_precondition():
    import asyncio

    from services.common.errors import FailedPrecondition
    from services.inference.servicer import InferenceServicer

    servicer = InferenceServicer(InferenceServiceConfig(), None)
    request = pb.RewardRequest(inputs=[pb.RewardInput(text="hi")])
    with pytest.raises(FailedPrecondition, match="no model loaded"):
        asyncio.run(servicer.Reward(request, None))  # type: ignore[arg-type]
