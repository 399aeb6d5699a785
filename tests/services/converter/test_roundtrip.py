"""HF → Megatron TP2×PP2 → native → HF is bit-identical, and each hop is a loadable checkpoint:
transformers loads the HF output, the trainer's CheckpointManager the native one, and the Megatron
files have Megatron's layout (tracker, mp_rank grid, args, names, per-rank shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from checkpoints.megatron_format import load_file as load_megatron
from checkpoints.native_format import NativeSource
from models import build_model
from models.config import ModelConfig
from services.converter.job import ConvertOptions, convert
from services.converter.verify import fixed_logits, load_model
from tests.services.converter.conftest import VOCAB
from training.checkpoint import CheckpointManager, TrainState


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_hf_megatron_native_hf_is_bit_identical(family, llama_dir, bloom_dir, tmp_path):
    hf_dir = llama_dir if family == "llama" else bloom_dir
    megatron, native, back = tmp_path / "mg", tmp_path / "native", tmp_path / "hf"
    convert(ConvertOptions("hf", "megatron", hf_dir, megatron, target_tp=2, target_pp=2))
    convert(ConvertOptions("megatron", "native", megatron, native))
    report = convert(ConvertOptions("native", "hf", native, back))

    start, end = _hf_tensors(hf_dir), _hf_tensors(back)
    assert sorted(start) == sorted(end)
    for name in start:
        assert start[name].dtype == end[name].dtype, name
        assert torch.equal(start[name], end[name]), name
    assert report.num_tensors == len(load_model(NativeSource(native)).state_dict()) - (
        family == "bloom"  # the tied head is one tensor, listed twice in a state dict
    )
    if family == "llama":  # the tokenizer travelled HF → Megatron → native → HF
        assert (back / "tokenizer.model").read_bytes() == (hf_dir / "tokenizer.model").read_bytes()

    # transformers reads our HF output (config.json included) and computes the same logits.
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    original = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    converted = AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert torch.equal(original(ids).logits, converted(ids).logits)


def test_megatron_layout_on_disk(llama_dir, tmp_path):
    out = tmp_path / "mg"
    convert(ConvertOptions("hf", "megatron", llama_dir, out, target_tp=2, target_pp=2))
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    ranks = sorted(p.name for p in (out / "release").iterdir())
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    first = load_megatron(out / "release" / "mp_rank_01_000" / "model_optim_rng.pt")
    last = load_megatron(out / "release" / "mp_rank_01_001" / "model_optim_rng.pt")
    args = first["args"]
    assert first["checkpoint_version"] == 3.0
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert (args.num_query_groups, args.group_query_attention, args.swiglu) == (2, True, True)
    assert args.padded_vocab_size == 256  # 200 padded to a multiple of 128 * TP 2
    lm = first["model"]["language_model"]
    # Stage 0 holds the embedding and layers 0-1 (local names), TP rank 1 half of each split.
    assert lm["embedding"]["word_embeddings"]["weight"].shape == (128, 64)
    encoder = lm["encoder"]
    assert sorted({k.split(".")[1] for k in encoder}) == ["0", "1"]
    # qkv: one query group per rank: (2 q heads + k + v) x head_dim 16 rows.
    assert encoder["layers.0.self_attention.query_key_value.weight"].shape == (64, 64)
    assert encoder["layers.0.self_attention.dense.weight"].shape == (64, 32)
    assert encoder["layers.0.mlp.dense_h_to_4h.weight"].shape == (96, 64)  # [gate; up] halves
    assert encoder["layers.0.mlp.dense_4h_to_h.weight"].shape == (64, 48)
    assert encoder["layers.0.input_norm.weight"].shape == (64,)
    assert "output_layer" not in lm
    last_lm = last["model"]["language_model"]
    assert last_lm["output_layer"]["weight"].shape == (128, 64)
    assert "encoder.final_norm.weight" not in last_lm and "final_norm.weight" in last_lm["encoder"]
    # The padding rows are zeros and the real rows are the HF head's second half (rank 1).
    head = _hf_tensors(llama_dir)["lm_head.weight"]
    assert torch.equal(last_lm["output_layer"]["weight"][: VOCAB - 128], head[128:])
    assert not last_lm["output_layer"]["weight"][VOCAB - 128 :].any()
    config = ModelConfig.from_dict(json.loads(args.meshline_model_config))
    assert config.kv_heads == 2 and config.vocab_size == VOCAB


def test_native_output_loads_in_the_trainer(llama_dir, tmp_path):
    native = tmp_path / "native"
    convert(ConvertOptions("hf", "native", llama_dir, native))
    config = ModelConfig.from_dict(json.loads((native / "step-000000" / "config.json").read_text()))
    model = build_model(config, device="cpu")
    CheckpointManager(native).load("latest", TrainState(model, save_rng=False))
    hf = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_trainer_checkpoint_converts_to_hf(tmp_path):
    # A checkpoint the trainer itself wrote (tied Bloom: lm_head and embedding stored twice).
    from models.registry import get_config

    config = get_config("tiny-bloom")
    model = build_model(config, device="cpu")
    model.init_weights(seed=3)
    CheckpointManager(tmp_path / "run", model_config=config.to_dict()).save(
        7, TrainState(model, save_rng=False)
    )
    convert(ConvertOptions("native", "hf", tmp_path / "run", tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ids = torch.randint(
            0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
        )
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(
        fixed_logits(load_model(NativeSource(tmp_path / "run"))), fixed_logits(model)
    )


def test_sharded_hf_output_has_an_index(llama_dir, tmp_path):
    out = tmp_path / "sharded"
    report = convert(
        ConvertOptions("hf", "hf", llama_dir, out, dtype="bf16", max_shard_bytes=60_000)
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(shards) <= set(report.files)
    start = _hf_tensors(llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in hf.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, start[name].to(torch.bfloat16)), name
    # The sharded checkpoint reads back as a source through its index.
    convert(ConvertOptions("hf", "hf", out, tmp_path / "single", max_shard_bytes=10**9))
    single = _hf_tensors(tmp_path / "single")
    assert all(torch.equal(single[n], start[n].to(torch.bfloat16)) for n in start)


@pytest.mark.parametrize("name", ["tiny-baichuan", "tiny-internlm"])
def test_baichuan_w_pack_and_qkv_bias_round_trip(name, tmp_path):
    # Families without a transformers class: start from a trainer checkpoint, go through HF
    # (Baichuan's fused W_pack, InternLM's q/k/v/o biases) and Megatron TP2 (biases split per
    # query group) and back; the weights must come back bit-identical.
    from models.registry import get_config

    config = get_config(name, num_layers=2)
    model = build_model(config, device="cpu")
    model.init_weights(seed=4)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_()  # biases and norm scales that are not all 0 / 1
    CheckpointManager(tmp_path / "run", model_config=config.to_dict()).save(
        3, TrainState(model, save_rng=False)
    )
    convert(ConvertOptions("native", "hf", tmp_path / "run", tmp_path / "hf"))
    hf_names = set(_hf_tensors(tmp_path / "hf"))
    if name == "tiny-baichuan":
        assert "model.layers.0.self_attn.W_pack.weight" in hf_names
    else:
        assert "model.layers.0.self_attn.q_proj.bias" in hf_names
    convert(ConvertOptions("hf", "megatron", tmp_path / "hf", tmp_path / "mg", target_tp=2))
    convert(ConvertOptions("megatron", "native", tmp_path / "mg", tmp_path / "back", verify=True))
    back = load_model(NativeSource(tmp_path / "back")).state_dict()
    for key, tensor in model.state_dict().items():
        assert torch.equal(back[key], tensor), key


def test_hf_output_keeps_the_source_config_keys(llama_dir, tmp_path):
    source = json.loads((llama_dir / "config.json").read_text())
    source["eos_token_id"], source["custom_note"] = 7, "kept"
    (tmp_path / "src").mkdir()
    for path in llama_dir.iterdir():
        (tmp_path / "src" / path.name).write_bytes(path.read_bytes())
    (tmp_path / "src" / "config.json").write_text(json.dumps(source))
    (tmp_path / "src" / "modeling_custom.py").write_text("# remote code travels as a file\n")
    convert(ConvertOptions("hf", "hf", tmp_path / "src", tmp_path / "out", dtype="fp16"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["eos_token_id"], written["custom_note"], written["dtype"]) == (
        7,
        "kept",
        "float16",
    )
    assert (tmp_path / "out" / "modeling_custom.py").is_file()
