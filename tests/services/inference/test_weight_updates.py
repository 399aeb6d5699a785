"""UpdateWeights on a real localhost server, pushed by the trainer's client (meshline_client).

The server loads HF model A; the client pushes other models' weights as new versions (full,
partial, or LoRA factors merged as `models.lora.LoraLinear.merged_weight` merges them), and the
served greedy tokens must then be exactly HF `generate`'s on those weights. Every refused
update (wrong shape — the bad tensor sent last, after the valid ones were staged — wrong dtype,
stale version, unknown name, missing or extra bytes, no token, no --allow-weight-updates) must
leave the previous weights serving: same tokens, same version.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from meshline_client import Connection
from meshline_client.weight_sync import (
    RolloutClient,
    lora_factors,
    named_tensors,
    resolve_endpoints,
    update_bodies,
    update_messages,
)
from models.hf_adapters import to_hf
from models.lora import LoraConfig, LoraLinear, apply_lora
from services.common.config import ServerConfig
from services.common.server import create_server
from services.inference.config import InferenceServiceConfig, check_weight_update_auth
from services.inference.servicer import bindings, load_engine
from tests.services.inference.helpers import hf_generate, hf_reference, prompt, save_hf_checkpoint

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "rollout-s3cret"
PROMPTS = [prompt(6, 512, seed=s) for s in (1, 2)]
NEW_TOKENS = 10
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    hf, _, config = hf_reference("llama-gqa", seed=2, vocab_size=512)
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"), sentencepiece_model)
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    allowed = InferenceServiceConfig(load=directory, max_batch_rows=8, allow_weight_updates=True)
    engine = load_engine(allowed)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def start(config: InferenceServiceConfig) -> tuple[object, int]:
        server_config = ServerConfig(host="127.0.0.1", port=0, auth_token_file=str(token_file))
        made = create_server(bindings(config, engine), server_config)
        server, port, _ = asyncio.run_coroutine_threadsafe(made, loop).result(30)
        return server, port

    server, port = start(allowed)
    # The same engine behind a second server started without --allow-weight-updates.
    plain_server, plain_port = start(InferenceServiceConfig(load=directory, max_batch_rows=8))
    [address] = resolve_endpoints(f"localhost:{port}")  # as a headless Service resolves
    client = RolloutClient([Connection(address, token=TOKEN, timeout_s=120)])
    yield client, port, plain_port, hf, config
    client.close()
    for s in (server, plain_server):
        asyncio.run_coroutine_threadsafe(s.stop(0), loop).result(30)
    asyncio.run_coroutine_threadsafe(engine.front.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def others():
    """Two more models of the same shapes: (HF, Meshline) with seeds 3 and 4."""
    return [hf_reference("llama-gqa", seed=seed, vocab_size=512)[:2] for seed in (3, 4)]


def _served_tokens(client: RolloutClient) -> list[list[int]]:
    groups = client.rollouts(PROMPTS, n=1, max_new_tokens=NEW_TOKENS)
    return [group[0].token_ids for group in groups]


def _hf_tokens(hf) -> list[list[int]]:
    out = []
    for ids in PROMPTS:
        full = hf_generate(hf, ids, max_new_tokens=NEW_TOKENS)
        out.append(full[0, len(ids) :].tolist())
    return out


def _stub(port: int) -> pb_grpc.InferenceServiceStub:
    return pb_grpc.InferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def test_push_full_update_serves_exactly_the_new_weights(served, others):
    client, _, _, hf_a, _ = served
    before = _served_tokens(client)
    assert before == _hf_tokens(hf_a)
    hf_b, ours_b = others[0]
    version = next(_versions)
    [result] = client.push(ours_b, version)
    expected = _hf_tokens(hf_b)
    assert expected != before  # the test can tell the weights apart
    assert (result.version, result.num_tensors) == (version, len(named_tensors(ours_b)))
    assert result.num_bytes == sum(p.numel() * 4 for p in ours_b.parameters())
    assert result.seconds > 0 and result.swap_seconds >= 0
    assert client.versions() == [version]
    assert REGISTRY.get_sample_value("meshline_inference_weights_version") == version
    swaps = "meshline_inference_weight_update_seconds_count"
    assert REGISTRY.get_sample_value(swaps, {"phase": "swap"}) >= 1
    assert _served_tokens(client) == expected
    # Sampled rollouts: n completions per prompt over gRPC.
    groups = client.rollouts(PROMPTS, n=3, do_sample=True, seed=7, max_new_tokens=4, logprobs=1)
    assert [len(g) for g in groups] == [3, 3]
    assert all(len(c.token_ids) == 4 and len(c.token_logprobs) == 4 for g in groups for c in g)


def test_partial_update_replaces_only_the_named_tensors(served, others):
    client, _, _, _, config = served
    (_, ours_b), (_, ours_c) = others
    client.push(ours_b, next(_versions))
    subset = {n: t for n, t in ours_c.named_parameters() if n.startswith("layers.1.")}
    [result] = client.push(subset, next(_versions), partial=True)
    assert result.num_tensors == len(subset)
    mixed = {**dict(ours_b.named_parameters()), **subset}
    reference, _, _ = hf_reference("llama-gqa", seed=0, vocab_size=512)
    reference.load_state_dict(to_hf({n: t.detach() for n, t in mixed.items()}, config))
    assert _served_tokens(client) == _hf_tokens(reference)


def _with_adapters(base, targets: list[str], seed: int):
    """A copy of `base` with LoRA adapters (r 4, alpha 8) on `targets`, B random (not zero)."""
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(r=4, alpha=8.0, target_modules=targets), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.lora_B.weight.copy_(
                    0.5 * torch.randn(module.lora_B.weight.shape, generator=gen)
                )
    return model


def _hf_of(meshline_state: dict, config):
    reference, _, _ = hf_reference("llama-gqa", seed=0, vocab_size=512)
    reference.load_state_dict(to_hf({n: t.detach() for n, t in meshline_state.items()}, config))
    return reference


def _merged(base, adapted) -> dict:
    """`base`'s parameters with each adapted layer's weight merged (LoraLinear.merged_weight)."""
    state = dict(base.named_parameters())
    for name, module in adapted.named_modules():
        if isinstance(module, LoraLinear):
            state[f"{name}.weight"] = module.merged_weight()
    return state


def test_lora_update_serves_base_plus_adapter_and_replaces_the_adapter(served, others):
    client, port, _, _, config = served
    _, ours_b = others[0]
    client.push(ours_b, next(_versions))
    first = _with_adapters(ours_b, ["qkv_proj", "o_proj"], seed=11)
    factors = lora_factors(first)
    assert len(factors) == 8  # 2 layers x 2 modules x (A, B)
    version = next(_versions)
    [result] = client.push(factors, version, lora_scaling=8.0 / 4)
    assert (result.version, result.num_tensors) == (version, 8)
    assert _served_tokens(client) == _hf_tokens(_hf_of(_merged(ours_b, first), config))
    # A new adapter on o_proj only: qkv_proj goes back to its base, o_proj = base + new delta.
    second = _with_adapters(ours_b, ["o_proj"], seed=12)
    client.push(lora_factors(second), next(_versions), lora_scaling=2.0)
    assert _served_tokens(client) == _hf_tokens(_hf_of(_merged(ours_b, second), config))
    # Refused: a rank past the weight's, A without B, a factor of no served layer, no scaling.
    stub, served_version = _stub(port), client.versions()[0]
    a_name = "layers.0.self_attn.o_proj.lora_A.weight"
    b_name = "layers.0.self_attn.o_proj.lora_B.weight"
    cases = {
        "rank 40": (
            [(a_name, torch.zeros(40, 64)), (b_name, torch.zeros(64, 40))],
            2.0,
            f"tensor '{a_name}': rank 40",
        ),
        "A alone": (
            [(a_name, torch.zeros(4, 64))],
            2.0,
            "num_tensors: a lora update sends A and B",
        ),
        "A, A": (
            [
                (a_name, torch.zeros(4, 64)),
                ("layers.1.self_attn.o_proj.lora_A.weight", torch.zeros(4, 64)),
            ],
            2.0,
            f"tensor '{b_name}': missing",
        ),
        "ranks differ": (
            [(a_name, torch.zeros(4, 64)), (b_name, torch.zeros(64, 8))],
            2.0,
            f"tensor '{b_name}': shape [64, 8] differs from the [64, 4]",
        ),
        "no layer": (
            [("layers.0.input_layernorm.lora_A.weight", torch.zeros(4, 64))] * 2,
            2.0,
            "of linear layers whose",
        ),
        "no scaling": (
            [(a_name, torch.zeros(4, 64)), (b_name, torch.zeros(64, 4))],
            0.0,
            "lora_scaling",
        ),
    }
    for case, (tensors, scaling, words) in cases.items():
        messages = update_messages(tensors, served_version + 1, lora_scaling=scaling)
        with pytest.raises(grpc.RpcError) as refused:
            stub.UpdateWeights(messages, metadata=AUTH, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert words in refused.value.details(), (case, refused.value.details())
    assert client.versions() == [served_version]
    assert _served_tokens(client) == _hf_tokens(_hf_of(_merged(ours_b, second), config))
    # A full update after adapters: the new weights alone (no adapter left on top).
    client.push(ours_b, next(_versions))
    assert _served_tokens(client) == _hf_tokens(others[0][0])


def _bad_updates(ours_b, served: int) -> dict[str, tuple[list, grpc.StatusCode, str]]:
    """Each refused case: (messages, status code, words the status message must contain)."""
    version = served + 1
    tensors = named_tensors(ours_b)
    name, weight = next((n, t) for n, t in tensors if t.dim() == 2 and t.shape[0] != t.shape[1])
    last_name, last = tensors[-1]
    wrong_last_shape = [*tensors[:-1], (last_name, last.reshape(-1)[:-1])]
    swapped = [(n, weight.t() if n == name else t) for n, t in tensors]
    as_bf16 = [(n, t.to(torch.bfloat16) if n == name else t) for n, t in tensors]
    unknown = [*tensors[:-1], ("layers.0.not_a_weight", last)]
    messages = list(update_messages(tensors, version))
    first = next(i for i, m in enumerate(messages) if m.WhichOneof("part") == "chunk")
    extra = pb.UpdateWeightsRequest(
        chunk=pb.WeightChunk(name=last_name, offset=last.numel() * 4, data=b"\0" * 4)
    )
    return {
        "wrong shape, sent last": (
            list(update_messages(wrong_last_shape, version)),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor '{last_name}': shape",
        ),
        "transposed": (
            list(update_messages(swapped, version)),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor '{name}': shape",
        ),
        "wrong dtype": (
            list(update_messages(as_bf16, version)),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor '{name}': dtype 'bfloat16' differs from the served 'float32'",
        ),
        "unknown name": (
            list(update_messages(unknown, version)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "'layers.0.not_a_weight': is not a parameter",
        ),
        "stale version": (
            list(update_messages(tensors, served)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "is not newer than the version being served",
        ),
        "a tensor missing": (
            [messages[0], *(m for m in messages[first:] if m.chunk.name != name)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "not sent: ['" + name,
        ),
        "bytes past the tensor": (
            [*messages, extra],
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor '{last_name}': {last.numel() * 4 + 4} bytes sent, more than",
        ),
        "no header": (messages[first:], grpc.StatusCode.INVALID_ARGUMENT, "header"),
    }


def test_refused_updates_leave_the_previous_weights_serving(served, others):
    client, port, _, _, _ = served
    hf_b, ours_b = others[0]
    version = next(_versions)
    client.push(ours_b, version)
    expected = _hf_tokens(hf_b)
    stub = _stub(port)
    for case, (messages, code, words) in _bad_updates(ours_b, version).items():
        with pytest.raises(grpc.RpcError) as refused:
            stub.UpdateWeights(iter(messages), metadata=AUTH, timeout=60)
        assert refused.value.code() == code, case
        assert words in refused.value.details(), (case, refused.value.details())
        assert client.versions() == [version], case
    assert _served_tokens(client) == expected


def test_unauthenticated_and_not_allowed_updates_are_refused(served, others):
    client, port, plain_port, _, _ = served
    hf_b, ours_b = others[0]
    version = next(_versions)
    client.push(ours_b, version)
    good = list(update_messages(named_tensors(others[1][1]), version + 1))
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as refused:
            _stub(port).UpdateWeights(iter(good), metadata=metadata, timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as refused:
        _stub(plain_port).UpdateWeights(iter(good), metadata=AUTH, timeout=60)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--allow-weight-updates" in refused.value.details()
    plain = _stub(plain_port).GetWeightsVersion(pb.GetWeightsVersionRequest(), metadata=AUTH)
    assert not plain.updates_allowed
    assert client.versions() == [version]
    assert _served_tokens(client) == _hf_tokens(hf_b)


def test_weight_update_flags_are_checked_before_loading(tmp_path):
    allowed = InferenceServiceConfig(allow_weight_updates=True)
    with pytest.raises(ValueError, match="--allow-weight-updates needs --auth-token-file"):
        check_weight_update_auth(allowed, None)
    check_weight_update_auth(allowed, "token-file")
    assert allowed.engine_config().cpu_linear == "dense"
    assert InferenceServiceConfig().engine_config().cpu_linear == "auto"
    with pytest.raises(ValueError, match="--cpu-linear packed serves a packed copy"):
        InferenceServiceConfig(allow_weight_updates=True, cpu_linear="packed")
    with pytest.raises(ValueError, match="--allow-weight-updates serves from one process"):
        InferenceServiceConfig(allow_weight_updates=True, tensor_parallel_size=2)


@pytest.mark.slow  # a subprocess importing torch: ~30 s on the shared 2-core box
def test_serve_refuses_weight_updates_without_a_token(tmp_path):
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    result = subprocess.run(
        [*command, "--load", str(tmp_path), "--allow-weight-updates"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--allow-weight-updates needs --auth-token-file" in result.stderr


def test_fast_encoding_is_the_protobuf_message():
    tensors = [("a", torch.arange(10.0)), ("b", torch.randn(3, 700).to(torch.bfloat16))]
    bodies = list(update_bodies(tensors, 3, partial=True, chunk_bytes=1024))
    expected = [
        pb.UpdateWeightsRequest(
            header=pb.WeightUpdateHeader(
                version=3, kind=pb.WEIGHT_UPDATE_KIND_PARTIAL, num_tensors=2
            )
        )
    ]
    for name, tensor in tensors:
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        for offset in range(0, len(raw), 1024):
            chunk = pb.WeightChunk(name=name, offset=offset, data=raw[offset : offset + 1024])
            if offset == 0:
                chunk.dtype = str(tensor.dtype).removeprefix("torch.")
                chunk.shape.extend(tensor.shape)
            expected.append(pb.UpdateWeightsRequest(chunk=chunk))
    assert [pb.UpdateWeightsRequest.FromString(b) for b in bodies] == expected


def test_a_prompt_cached_before_an_update_is_computed_again_after_it(served, others):
    """The prefix cache holds KV blocks computed with the weights served when a prompt came; after
    an update the same prompt must be computed with the new weights, not reuse those blocks."""
    client, _, _, _, _ = served
    long = [prompt(40, 512, seed=11)]  # two full 16-token blocks to cache
    client.rollouts(long, n=1, max_new_tokens=2)
    hf_c, ours_c = others[1]
    [result] = client.push(ours_c, next(_versions))
    assert client.versions() == [result.version]
    [[completion]] = client.rollouts(long, n=1, max_new_tokens=NEW_TOKENS)
    expected = hf_generate(hf_c, long[0], max_new_tokens=NEW_TOKENS)[0, len(long[0]) :].tolist()
    assert completion.token_ids == expected
