"""Loading for serving (through the converter's readers): HF safetensors dirs, native trainer
checkpoints, Megatron TP/PP checkpoints, LoRA merged like peft, one-line errors for bad dirs."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from engine.loading import detect_format, load_checkpoint
from models import build_model
from models.registry import get_config
from tests.services.inference.helpers import hf_reference, save_hf_checkpoint
from training.checkpoint import CheckpointManager, TrainState

IDS = torch.tensor([[5, 9, 33, 7, 100, 42, 18]])
ATOL = 1e-5


def _logits(model):
    with torch.no_grad():
        out = model(IDS)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_hf_directory_serves_the_hf_model(tmp_path, name, sentencepiece_model):
    hf, _, _ = hf_reference(name)
    directory = save_hf_checkpoint(hf, tmp_path / "ckpt", sentencepiece_model)
    assert detect_format(directory) == "hf"
    loaded = load_checkpoint(directory)
    assert loaded.load_format == "hf" and loaded.tokenizer is not None
    assert (_logits(loaded.model) - _logits(hf)).abs().max().item() <= ATOL
    half = load_checkpoint(directory, dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16


def test_native_checkpoint_latest_step(tmp_path):
    config = get_config("tiny-bloom")
    model = build_model(config, device="cpu")
    model.init_weights(seed=4)
    manager = CheckpointManager(tmp_path / "save", model_config=config.to_dict())
    manager.save(7, TrainState(model, extra={"step": 7}, save_rng=False))
    manager.wait()
    loaded = load_checkpoint(tmp_path / "save")
    assert loaded.load_format == "native"
    assert torch.equal(_logits(loaded.model), _logits(model))


def test_megatron_tp2_pp2_checkpoint_serves_whole(tmp_path):
    from services.converter.job import ConvertOptions, convert

    hf, _, _ = hf_reference("llama-gqa")
    hf_dir = save_hf_checkpoint(hf, tmp_path / "hf")
    options = ConvertOptions("hf", "megatron", hf_dir, tmp_path / "mg", target_tp=2, target_pp=2)
    convert(options)
    assert detect_format(tmp_path / "mg") == "megatron"
    loaded = load_checkpoint(tmp_path / "mg")
    assert loaded.load_format == "megatron"
    assert (_logits(loaded.model) - _logits(hf)).abs().max().item() <= ATOL


def test_lora_merged_like_peft_merge_and_unload(tmp_path):
    hf, _, _ = hf_reference("llama-gqa")
    base_dir = save_hf_checkpoint(hf, tmp_path / "base")
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
        init_lora_weights=False,
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(hf, lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    reference = peft_model.merge_and_unload()
    loaded = load_checkpoint(base_dir, lora=tmp_path / "adapter")
    base = load_checkpoint(base_dir)
    assert (_logits(loaded.model) - _logits(reference)).abs().max().item() <= ATOL
    assert (_logits(base.model) - _logits(reference)).abs().max().item() > 1e-3


def test_bad_directories_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--load"):
        load_checkpoint(tmp_path)
    (tmp_path / "adapter").mkdir()
    hf, _, _ = hf_reference("llama-gqa")
    base_dir = save_hf_checkpoint(hf, tmp_path / "base")
    with pytest.raises(ValueError, match="--lora-load"):
        load_checkpoint(base_dir, lora=tmp_path / "adapter")
    config = {"r": 2, "lora_alpha": 4, "peft_type": "LORA"}
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"--lora-load .*adapter_model\.safetensors"):
        load_checkpoint(base_dir, lora=tmp_path / "adapter")
    with pytest.raises(ValueError, match="Megatron"):
        load_checkpoint(base_dir, load_format="megatron")
