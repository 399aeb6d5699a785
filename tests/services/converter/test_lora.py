"""LoRA merge equals peft's `merge_and_unload` on the same weights (Llama GQA and Bloom's fused
query_key_value), from an HF base and from a TP-sharded Megatron base."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.converter.job import ConvertOptions, convert
from tests.services.converter.conftest import VOCAB

# Merging adds B·A once per weight in fp32; peft does the same arithmetic, so the two agree to
# the last bit or within fp32 rounding of the product.
ATOL = 1e-6

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "bloom": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def _adapter(base_dir, out_dir, family, use_rslora=False):
    """A peft LoRA with random A and B (init_lora_weights=False), saved; returns peft's merge."""
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=TARGETS[family],
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    torch.manual_seed(0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # make the delta large enough that a missed module shows
                param.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


@pytest.mark.parametrize(("family", "rslora"), [("llama", False), ("bloom", True)])
def test_merge_equals_peft(family, rslora, llama_dir, bloom_dir, tmp_path):
    base_dir = llama_dir if family == "llama" else bloom_dir
    merged_by_peft = _adapter(base_dir, tmp_path / "adapter", family, rslora)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    out = tmp_path / "merged"
    convert(ConvertOptions("hf", "hf", base_dir, out, lora_dir=tmp_path / "adapter", verify=True))
    ours = load_file(out / "model.safetensors")
    theirs = merged_by_peft.state_dict()
    base = load_file(base_dir / "model.safetensors")
    changed = 0
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], atol=ATOL, rtol=0)
        changed += not torch.equal(tensor, base[name])
    assert changed == 4 * len(TARGETS[family])  # every adapted weight of the 4 layers moved
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(out)(ids).logits,
            merged_by_peft(ids).logits,
            atol=1e-4,
            rtol=0,
        )


def test_merge_from_a_tp_sharded_megatron_base(llama_dir, tmp_path):
    merged_by_peft = _adapter(llama_dir, tmp_path / "adapter", "llama")
    convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "mg", target_tp=2, target_pp=2))
    convert(
        ConvertOptions(
            "megatron", "hf", tmp_path / "mg", tmp_path / "merged", lora_dir=tmp_path / "adapter"
        )
    )
    ours = load_file(tmp_path / "merged" / "model.safetensors")
    for name, tensor in merged_by_peft.state_dict().items():
        torch.testing.assert_close(ours[name], tensor, atol=ATOL, rtol=0)


def test_adapter_for_another_model_is_refused(llama_dir, bloom_dir, tmp_path):
    _adapter(bloom_dir, tmp_path / "adapter", "bloom")
    with pytest.raises(ValueError, match="LoRA modules"):
        convert(
            ConvertOptions("hf", "hf", llama_dir, tmp_path / "out", lora_dir=tmp_path / "adapter")
        )
    assert not (tmp_path / "out").exists()


def test_modules_to_save_replace_their_weights_as_peft_merges_them(llama_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(llama_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                        modules_to_save=["lm_head", "embed_tokens"])  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:  # the trained copies differ from the base
                param.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    merged_by_peft = model.merge_and_unload().eval()
    out = tmp_path / "merged"
    convert(ConvertOptions("hf", "hf", llama_dir, out, lora_dir=tmp_path / "adapter"))
    ours = load_file(out / "model.safetensors")
    base_weights = load_file(llama_dir / "model.safetensors")
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        assert not torch.equal(ours[name], base_weights[name]), name
    for name, tensor in merged_by_peft.state_dict().items():
        torch.testing.assert_close(ours[name], tensor, atol=ATOL, rtol=0)
