"""Megatron/ModelLink LoRA checkpoints saved per TP rank (peft LoraParallelLinear's split: column
layers keep lora_A whole and split lora_B's rows, row layers split lora_A's columns and keep lora_B
whole) merge into the base exactly as the TP model computed: equal to merging each rank's shard of
a Megatron base by hand, to merging the same adapter unsplit (TP1), and — for Bloom, whose HF
modules are Megatron's — to peft's merge_and_unload of the adapter it came from."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from checkpoints.megatron_format import load_file as load_megatron
from services.converter.job import ConvertOptions, convert
from tests.services.converter.conftest import VOCAB

R, ALPHA = 4, 16.0
COLUMN = ("self_attention.query_key_value", "mlp.dense_h_to_4h")
ROW = ("self_attention.dense", "mlp.dense_4h_to_h")
Adapter = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
"""(global layer, Megatron module) -> (A [r, in], B [out, r]) of the whole (TP1) layer."""


def _args(config: dict, tp: int, pp: int, lora: bool = True) -> argparse.Namespace:
    args = argparse.Namespace(
        num_layers=config["num_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        ffn_hidden_size=config["ffn_hidden_size"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        lora_target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    )
    if lora:
        args.lora_r, args.lora_alpha = R, ALPHA
    return args


def _split_for_rank(adapter: Adapter, rank: int, tp: int, gated: bool) -> Adapter:
    """Rank `rank`'s pieces of each pair, as LoraParallelLinear holds them."""
    out: Adapter = {}
    for (layer, module), (a, b) in adapter.items():
        if module in ROW:
            out[(layer, module)] = (a.chunk(tp, dim=1)[rank], b)
        elif module == "mlp.dense_h_to_4h" and gated:  # rank r holds [gate rows of r; up rows of r]
            gate, up = b.chunk(2, dim=0)
            out[(layer, module)] = (a, torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]))
        else:  # query groups are whole per rank: contiguous rows
            out[(layer, module)] = (a, b.chunk(tp, dim=0)[rank])
    return out


def write_megatron_lora(
    adapter: Adapter, directory: Path, config: dict, tp: int, pp: int, args: bool = True
) -> Path:
    """A ModelLink LoRA checkpoint: iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt, local
    layer numbers per stage, keys `encoder.layers.<local>.<module>.lora_{A,B}.default.weight`."""
    per_stage = config["num_layers"] // pp
    for rank in range(tp):
        pieces = _split_for_rank(adapter, rank, tp, config["activation"] == "swiglu")
        for stage in range(pp):
            encoder = {}
            for (layer, module), (a, b) in pieces.items():
                if layer // per_stage == stage:
                    prefix = f"layers.{layer % per_stage}.{module}"
                    encoder[f"{prefix}.lora_A.default.weight"] = a.clone()
                    encoder[f"{prefix}.lora_B.default.weight"] = b.clone()
            name = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
            path = directory / "iter_0000010" / name / "model_optim_rng.pt"
            path.parent.mkdir(parents=True)
            state = {
                "args": _args(config, tp, pp, lora=args),
                "checkpoint_version": 3.0,
                "iteration": 10,
                "model": {"language_model": {"encoder": encoder}},
            }
            torch.save(state, path)
    (directory / "latest_checkpointed_iteration.txt").write_text("10\n")
    return directory


def _random_adapter(config: dict, seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    hidden, ffn = config["hidden_size"], config["ffn_hidden_size"]
    heads = config["num_attention_heads"]
    qkv = (heads + 2 * (config["num_kv_heads"] or heads)) * (hidden // heads)
    up = 2 * ffn if config["activation"] == "swiglu" else ffn
    shapes = {  # module: (in, out)
        "self_attention.query_key_value": (hidden, qkv),
        "self_attention.dense": (hidden, hidden),
        "mlp.dense_h_to_4h": (hidden, up),
        "mlp.dense_4h_to_h": (ffn, hidden),
    }
    return {
        (layer, module): (
            torch.randn(R, i, generator=g) * 0.3,
            torch.randn(o, R, generator=g) * 0.3,
        )
        for layer in range(config["num_layers"])
        for module, (i, o) in shapes.items()
    }


def _meshline_config(megatron_dir: Path) -> dict:
    args = load_megatron(next(megatron_dir.glob("release/mp_rank_*/model_optim_rng.pt")))["args"]
    return json.loads(args.meshline_model_config)


def _merge_by_hand(base: Path, adapter: Adapter, config: dict, out: Path, tp: int) -> None:
    """Each TP rank's file of a Megatron TP`tp` base gets W_r + scale·B_r·A_r on its shard."""
    shutil.copytree(base, out)
    for rank in range(tp):
        pieces = _split_for_rank(adapter, rank, tp, config["activation"] == "swiglu")
        path = out / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        state = load_megatron(path)
        encoder = state["model"]["language_model"]["encoder"]
        for (layer, module), (a, b) in pieces.items():
            key = f"layers.{layer}.{module}.weight"
            encoder[key] = encoder[key] + (b @ a) * (ALPHA / R)
        partial = path.with_name("edit.pt")
        torch.save(state, partial)
        del state, encoder
        partial.replace(path)


def test_tp2_pp2_lora_merges_like_each_rank_and_like_the_unsplit_adapter(llama_dir, tmp_path):
    base_mg = tmp_path / "base-tp2"
    convert(ConvertOptions("hf", "megatron", llama_dir, base_mg, target_tp=2))
    config = _meshline_config(base_mg)
    adapter = _random_adapter(config, seed=5)
    write_megatron_lora(adapter, tmp_path / "lora-tp2pp2", config, tp=2, pp=2)
    write_megatron_lora(adapter, tmp_path / "lora-tp1", config, tp=1, pp=1)

    ours = tmp_path / "ours"
    convert(ConvertOptions("hf", "hf", llama_dir, ours, lora_dir=tmp_path / "lora-tp2pp2"))
    _merge_by_hand(base_mg, adapter, config, tmp_path / "by-hand-mg", tp=2)
    convert(ConvertOptions("megatron", "hf", tmp_path / "by-hand-mg", tmp_path / "by-hand"))
    unsplit = tmp_path / "unsplit"
    convert(ConvertOptions("hf", "hf", llama_dir, unsplit, lora_dir=tmp_path / "lora-tp1"))

    merged, by_hand = (
        load_file(ours / "model.safetensors"),
        load_file(tmp_path / "by-hand" / "model.safetensors"),
    )
    one_rank, base = (
        load_file(unsplit / "model.safetensors"),
        load_file(llama_dir / "model.safetensors"),
    )
    changed = 0
    for name, tensor in merged.items():
        assert torch.equal(tensor, by_hand[name]), name
        torch.testing.assert_close(tensor, one_rank[name], atol=1e-6, rtol=0)
        changed += not torch.equal(tensor, base[name])
    assert changed == 4 * 7  # q, k, v, o, gate, up, down of each of the 4 layers moved

    # A Megatron base at another TP, and a Megatron output, get the same weights.
    convert(
        ConvertOptions(
            "megatron", "hf", base_mg, tmp_path / "from-mg", lora_dir=tmp_path / "lora-tp2pp2"
        )
    )
    for name, tensor in load_file(tmp_path / "from-mg" / "model.safetensors").items():
        assert torch.equal(tensor, merged[name]), name


def test_bloom_tp2_lora_equals_peft_merge(bloom_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(bloom_dir)
    targets = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    torch.manual_seed(0)
    peft_model = get_peft_model(
        base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False)
    )
    adapter: Adapter = {}
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if hasattr(module, "lora_B") and "default" in getattr(module, "lora_B", {}):
                module.lora_B["default"].weight.normal_(0, 0.5)
                layer = int(name.split(".h.")[1].split(".")[0])
                megatron_module = name.split(f".h.{layer}.")[1]
                a = module.lora_A["default"].weight.detach().clone()
                adapter[(layer, megatron_module)] = (a, module.lora_B["default"].weight.clone())
    assert len(adapter) == 4 * len(targets)
    merged_by_peft = peft_model.merge_and_unload().eval()

    base_mg = tmp_path / "base"
    convert(ConvertOptions("hf", "megatron", bloom_dir, base_mg))
    config = _meshline_config(base_mg)
    write_megatron_lora(adapter, tmp_path / "lora", config, tp=2, pp=1, args=False)
    with pytest.raises(ValueError, match="pass --lora-r and --lora-alpha"):
        convert(ConvertOptions("hf", "hf", bloom_dir, tmp_path / "out", lora_dir=tmp_path / "lora"))
    convert(
        ConvertOptions(
            "hf",
            "hf",
            bloom_dir,
            tmp_path / "out",
            lora_dir=tmp_path / "lora",
            lora_r=R,
            lora_alpha=ALPHA,
            verify=True,
        )
    )
    ours = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in merged_by_peft.state_dict().items():
        if name in ours:
            torch.testing.assert_close(ours[name], tensor, atol=1e-6, rtol=0)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits,
            merged_by_peft(ids).logits,
            atol=1e-4,
            rtol=0,
        )


def test_lora_for_another_model_or_module_is_refused(llama_dir, bloom_dir, tmp_path):
    base_mg = tmp_path / "bloom-mg"
    convert(ConvertOptions("hf", "megatron", bloom_dir, base_mg))
    bloom = _meshline_config(base_mg)
    write_megatron_lora(_random_adapter(bloom, seed=1), tmp_path / "bloom-lora", bloom, 2, 1)
    with pytest.raises(ValueError, match=r"--lora-alpha 8\.0 contradicts the 16\.0"):
        convert(
            ConvertOptions(
                "hf",
                "hf",
                bloom_dir,
                tmp_path / "out",
                lora_dir=tmp_path / "bloom-lora",
                lora_alpha=8.0,
            )
        )
    with pytest.raises(ValueError, match=r"does not fit the model.*ffn_hidden_size=256"):
        convert(
            ConvertOptions(
                "hf", "hf", llama_dir, tmp_path / "out", lora_dir=tmp_path / "bloom-lora"
            )
        )
    odd = {(0, "self_attention.rotary"): (torch.zeros(R, 4), torch.zeros(4, R))}
    write_megatron_lora(odd, tmp_path / "odd-lora", bloom, 1, 1)
    with pytest.raises(ValueError, match="adapts a module outside"):
        convert(
            ConvertOptions("hf", "hf", bloom_dir, tmp_path / "out", lora_dir=tmp_path / "odd-lora")
        )
    assert not (tmp_path / "out").exists()
