"""LoRA adapters served by a real server on localhost (gRPC and the OpenAI HTTP front, with a
bearer token): --lora-modules from start-up, run-time load/unload, each request's `model` picking
its adapter with the tokens of its peft-merged model, bad input refused by name while other
streams go on untouched; prompt-lookup speculation on, verified with each row's adapter;
per-adapter metrics on /metrics."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json

import grpc
import openai
import pytest
import requests
from peft import PeftModel

from engine.speculative_config import SpeculativeConfig
from meshline.inference.v1 import inference_pb2 as pb
from services.common.config import ServerConfig
from services.common.errors import PermissionDenied
from services.inference.config import (
    InferenceServiceConfig,
    LoraModule,
    add_flags,
    from_args,
    parse_lora_module,
)
from services.inference.servicer import InferenceServicer
from tests.engine.test_multi_lora import save_adapter
from tests.services.inference.helpers import hf_generate, prompt
from tests.services.inference.http_served import ServerHarness, make_checkpoint

TOKEN = "lora-test-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model)
    root = tmp_path_factory.mktemp("root")
    adapters = {
        "qv": save_adapter(hf, root / "qv", 4, 8, ["q_proj", "v_proj"], 1),
        "mlp": save_adapter(hf, root / "mlp", 8, 16, ["gate_proj", "up_proj", "down_proj"], 2),
        "late": save_adapter(hf, root / "late", 2, 4, ["o_proj", "k_proj"], 3),
        "big": save_adapter(hf, root / "big", 16, 16, ["q_proj"], 4),
        "head": save_adapter(hf, root / "head", 4, 8, ["lm_head"], 5),
    }
    outside = save_adapter(hf, tmp_path_factory.mktemp("outside") / "x", 2, 4, ["q_proj"], 6)
    token_file = root / "token"
    token_file.write_text(TOKEN)
    limits = InferenceServiceConfig(
        load=directory,
        max_batch_rows=8,
        data_roots=(root,),
        lora_modules=[
            LoraModule("qv", adapters["qv"]),
            LoraModule("mlp", adapters["mlp"], "tiny-base"),
        ],
        max_loras=3,
        max_lora_rank=8,
        # Prompt lookup on: every adapter row's drafts are verified with its own adapter, so
        # the merged-model equalities below hold with speculation too.
        speculative_config=SpeculativeConfig("ngram", 3, 3, 1),
    )
    harness = ServerHarness(directory, hf, config, limits=limits, runtime_lora=True)
    s = harness.start(ServerConfig(host="127.0.0.1", port=0, auth_token_file=str(token_file)))
    client = openai.OpenAI(base_url=f"{s.http_url}/v1", api_key=TOKEN, max_retries=0)
    yield s, client, hf, adapters, outside
    harness.close()


def merged_tokens(hf, directory, ids, n):
    model = (
        hf if directory is None else PeftModel.from_pretrained(copy.deepcopy(hf), str(directory))
    )
    if directory is not None:
        model = model.merge_and_unload().eval()
    return hf_generate(model, ids, max_new_tokens=n)[0, len(ids) :].tolist()


def grpc_generate(stub, ids, adapter="", n=8):
    request = pb.GenerateRequest(
        prompt_token_ids=ids,
        params=pb.SamplingParams(max_new_tokens=n),
        lora_adapter=adapter,
    )
    return stub.Generate.future(request, metadata=AUTH, timeout=120)


def test_mixed_adapters_over_grpc_equal_their_merged_models(served):
    s, _, hf, adapters, _ = served
    vocab = s.config.vocab_size
    cases = [("qv", 6, 1), ("mlp", 6, 2), ("", 6, 3), ("qv", 9, 4), ("mlp", 4, 5)]
    futures = [grpc_generate(s.grpc_stub, prompt(n, vocab, seed), a) for a, n, seed in cases]
    got = [f.result().sequences[0].token_ids for f in futures]
    for (adapter, n, seed), tokens in zip(cases, got, strict=True):
        ids = prompt(n, vocab, seed)
        expected = merged_tokens(hf, adapters.get(adapter), ids, 8)
        assert list(tokens) == expected, adapter
    base = merged_tokens(hf, None, prompt(6, vocab, 2), 8)
    assert list(got[1]) != base  # the adapter changes the tokens (the test can fail)
    info = s.grpc_stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    assert list(info.lora_adapters)[:2] == ["qv", "mlp"]


def test_http_model_field_picks_the_adapter(served):
    s, client, _, _, _ = served
    ids = prompt(6, s.config.vocab_size, 7)
    by_grpc = {
        a: grpc_generate(s.grpc_stub, ids, a).result().sequences[0].text for a in ("", "mlp")
    }
    for adapter in ("", "mlp"):
        answer = client.completions.create(
            model=adapter or s.model_name, prompt=ids, max_tokens=8, temperature=0
        )
        assert answer.choices[0].text == by_grpc[adapter]
        assert answer.model == (adapter or s.model_name)
    assert by_grpc[""] != by_grpc["mlp"]
    listed = {m.id: m for m in client.models.list().data}
    assert listed["qv"].parent == s.model_name
    assert listed["mlp"].parent == "tiny-base"


def test_unknown_adapter_is_refused_by_name(served):
    s, client, _, _, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="nope", prompt=[5, 6, 7], max_tokens=2)
    error = info.value.body
    assert error["param"] == "model" and "'nope'" in error["message"]
    with pytest.raises(grpc.RpcError) as rpc:
        grpc_generate(s.grpc_stub, [5, 6, 7], "nope").result()
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_adapter" in rpc.value.details() and "'nope'" in rpc.value.details()


def test_load_and_unload_at_run_time_leave_other_streams_untouched(served):
    s, client, hf, adapters, outside = served
    url, headers = s.http_url, {"Authorization": f"Bearer {TOKEN}"}
    ids = prompt(5, s.config.vocab_size, 8)
    # A base-model request sent before the refusals and changes below keeps its tokens.
    running = grpc_generate(s.grpc_stub, ids, "", 40)

    def load(name, path, auth=True):
        body = {"lora_name": name, "lora_path": str(path)}
        return requests.post(
            f"{url}/v1/load_lora_adapter", json=body, headers=headers if auth else {}, timeout=60
        )

    assert load("late", adapters["late"], auth=False).status_code == 401
    refused = load("x", outside)
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "lora_path"
    linked = adapters["late"].parent / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").write_text(
        (adapters["late"] / "adapter_config.json").read_text()
    )
    (linked / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    assert load("linked", linked).status_code == 403
    big = load("big", adapters["big"])
    assert big.status_code == 400 and "--max-lora-rank 8" in big.json()["error"]["message"]
    head = load("head", adapters["head"])
    assert head.status_code == 400 and "lm_head" in head.json()["error"]["message"]
    ok = load("late", adapters["late"])
    assert ok.status_code == 200, ok.text
    assert load("late", adapters["late"]).status_code == 400  # the name is taken

    answer = client.completions.create(model="late", prompt=ids, max_tokens=8, temperature=0)
    assert answer.choices[0].text
    grpc_late = grpc_generate(s.grpc_stub, ids, "late").result().sequences[0].token_ids
    assert list(grpc_late) == merged_tokens(hf, adapters["late"], ids, 8)

    unload = {"lora_name": "late"}
    gone = requests.post(f"{url}/v1/unload_lora_adapter", json=unload, headers=headers, timeout=30)
    assert gone.status_code == 200
    again = requests.post(f"{url}/v1/unload_lora_adapter", json=unload, headers=headers, timeout=30)
    assert again.status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="late", prompt=ids, max_tokens=2)

    # gRPC's own load/unload
    s.grpc_stub.LoadLoraAdapter(
        pb.LoadLoraAdapterRequest(lora_name="late2", lora_path=str(adapters["late"])),
        metadata=AUTH,
    )
    with pytest.raises(grpc.RpcError) as rpc:
        s.grpc_stub.LoadLoraAdapter(
            pb.LoadLoraAdapterRequest(lora_name="big", lora_path=str(adapters["big"])),
            metadata=AUTH,
        )
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    s.grpc_stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="late2"), metadata=AUTH)

    tokens = running.result().sequences[0].token_ids
    assert list(tokens) == merged_tokens(hf, None, ids, 40)[: len(tokens)]


def test_runtime_loading_needs_an_authenticated_server(served):
    s, _, _, adapters, _ = served
    servicer = InferenceServicer(InferenceServiceConfig(), s.engine, runtime_lora=False)
    request = pb.LoadLoraAdapterRequest(lora_name="late", lora_path=str(adapters["late"]))
    with pytest.raises(PermissionDenied, match="--auth-token-file"):
        asyncio.run(servicer.LoadLoraAdapter(request, None))


def test_lora_flags_are_checked_before_any_weight(tmp_path, served):
    _, _, _, adapters, _ = served
    parser = argparse.ArgumentParser()
    add_flags(parser)

    def parsed(*argv):
        return from_args(parser.parse_args(["--load", str(tmp_path), *argv]))

    config = parsed("--lora-modules", f"qv={adapters['qv']}", "--max-lora-rank", "8")
    assert config.lora_modules == [LoraModule("qv", adapters["qv"])]
    assert config.engine_config().enable_lora and config.engine_config().max_loras == 1
    spec = json.dumps({"name": "m", "path": str(adapters["qv"]), "base_model_name": "b"})
    assert parse_lora_module(spec) == LoraModule("m", adapters["qv"], "b")
    with pytest.raises(ValueError, match="--max-loras needs --enable-lora"):
        parsed("--max-loras", "2")
    with pytest.raises(ValueError, match="rank 16 is over --max-lora-rank 8"):
        parsed("--lora-modules", f"big={adapters['big']}", "--max-lora-rank", "8")
    with pytest.raises(ValueError, match="not an existing adapter directory"):
        parsed("--lora-modules", f"x={tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="give name=DIR"):
        parsed("--lora-modules", "no-equals-sign")
    with pytest.raises(ValueError, match="--max-loras is 1"):
        parsed("--lora-modules", f"a={adapters['qv']}", f"b={adapters['mlp']}", "--max-loras", "1")
    with pytest.raises(ValueError, match="one process"):
        parsed("--enable-lora", "--tensor-parallel-size", "2")


def test_per_adapter_metrics_on_the_served_endpoint(served):
    """/metrics counts each adapter's requests, prompt and generated tokens and times to first
    token under its name (gRPC and HTTP alike); the label values are exactly the adapters
    loaded: a refused unknown name never appears, an unloaded adapter's series go."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.common.metrics import start_metrics_server

    s, client, _, adapters, _ = served
    url, headers = s.http_url, {"Authorization": f"Bearer {TOKEN}"}
    metrics = start_metrics_server("127.0.0.1", 0)
    scrape_url = f"http://127.0.0.1:{metrics.server_port}/metrics"

    def scrape() -> dict[str, dict[tuple, float]]:
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(requests.get(scrape_url, timeout=10).text):
            for sample in family.samples:
                if sample.name.startswith("meshline_inference_lora_"):
                    labels = tuple(sorted(sample.labels.items()))
                    out.setdefault(sample.name, {})[labels] = sample.value
        return out

    def adapters_in(samples) -> set[str]:
        return {dict(labels)["adapter"] for series in samples.values() for labels in series}

    try:
        body = {"lora_name": "metered", "lora_path": str(adapters["late"])}
        loaded = requests.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers)
        assert loaded.status_code == 200, loaded.text
        before = scrape()
        assert adapters_in(before) == {"qv", "mlp", "metered"}
        finished_before = before.get("meshline_inference_lora_requests_total", {})
        assert "metered" not in adapters_in({"r": finished_before})  # none finished yet
        assert before["meshline_inference_lora_prompt_tokens_total"][(("adapter", "metered"),)] == 0

        vocab = s.config.vocab_size
        prompts = [prompt(n, vocab, seed) for n, seed in ((5, 21), (7, 22), (4, 23))]
        generated = 0
        for ids in prompts[:2]:
            answer = client.completions.create(model="metered", prompt=ids, max_tokens=6)
            generated += answer.usage.completion_tokens
        by_grpc = grpc_generate(s.grpc_stub, prompts[2], "metered", n=5).result()
        generated += len(by_grpc.sequences[0].token_ids)
        grpc_generate(s.grpc_stub, prompts[0], "", n=3).result()  # the base model: no label
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="not-loaded-xyz", prompt=prompts[0], max_tokens=2)

        after = scrape()
        assert adapters_in(after) == {"qv", "mlp", "metered"}
        label = (("adapter", "metered"),)
        finished = {
            dict(k)["finish_reason"]: v
            for k, v in after["meshline_inference_lora_requests_total"].items()
            if dict(k)["adapter"] == "metered"
        }
        assert sum(finished.values()) == 3
        prompt_tokens = after["meshline_inference_lora_prompt_tokens_total"][label]
        assert prompt_tokens == sum(len(p) for p in prompts)
        assert after["meshline_inference_lora_generated_tokens_total"][label] == generated > 0
        ttft = after["meshline_inference_lora_time_to_first_token_seconds_count"][label]
        assert ttft == 3
        assert after["meshline_inference_lora_time_to_first_token_seconds_sum"][label] > 0
        qv = (("adapter", "qv"),)
        tokens = "meshline_inference_lora_generated_tokens_total"
        assert after[tokens][qv] == before[tokens][qv]  # other adapters' counts stay put
    finally:
        requests.post(
            f"{url}/v1/unload_lora_adapter", json={"lora_name": "metered"}, headers=headers
        )
        gone = scrape()
        metrics.shutdown()
        metrics.server_close()
    assert adapters_in(gone) == {"qv", "mlp"}
