"""Fixtures for the converter tests: tiny HF checkpoints written by transformers itself, DeepSpeed
checkpoints written by DeepSpeed itself."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM

VOCAB = 200  # not a multiple of 128: Megatron outputs must pad it and strip the padding again


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Non-trivial values everywhere (norm scales and biases too), so a swapped tensor shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def hf_llama_gqa(num_layers: int = 4) -> LlamaForCausalLM:
    """A Llama with grouped-query attention (4 query heads over 2 kv heads)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return _randomise(LlamaForCausalLM(config), seed=1).eval()


def hf_bloom(num_layers: int = 4) -> BloomForCausalLM:
    """A Bloom (ALiBi, LayerNorm, fused per-head query_key_value, tied head)."""
    config = BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=num_layers, n_head=4)
    return _randomise(BloomForCausalLM(config), seed=2).eval()


def save_hf(model: torch.nn.Module, directory: Path, tokenizer: Path | None = None) -> Path:
    """`save_pretrained` into `directory` (plus a tokenizer file to carry over)."""
    model.save_pretrained(directory)
    if tokenizer is not None:
        shutil.copy2(tokenizer, directory / "tokenizer.model")
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, sentencepiece_model: Path) -> Path:
    """An HF tiny Llama (GQA) checkpoint with a tokenizer.model."""
    return save_hf(hf_llama_gqa(), tmp_path_factory.mktemp("hf") / "llama", sentencepiece_model)


@pytest.fixture(scope="module")
def bloom_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF tiny Bloom checkpoint."""
    return save_hf(hf_bloom(), tmp_path_factory.mktemp("hf") / "bloom")


@pytest.fixture(scope="session")
def deepspeed_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints written by DeepSpeed itself on its CPU accelerator, 2 gloo ranks (about a
    minute): one directory per case of `deepspeed_writer.CASES` (see that module)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (`make setup` installs it)")
    from tests.services.converter.deepspeed_writer import write_all

    out = tmp_path_factory.mktemp("deepspeed")
    write_all(out)
    return out
