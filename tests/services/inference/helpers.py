"""Tiny HF reference models with random weights, converted into Meshline models for the engine."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from models import build_model
from models.hf_adapters import from_hf, hf_config
from models.registry import get_config

MODELS = {
    "llama-gqa": "tiny-llama-gqa",
    "bloom": "tiny-bloom",
    "mistral": "tiny-mistral",
    "gpt": "tiny-gpt",
}
EOS_ID = 2
PAD_ID = 1
"""HF fills finished rows with `pad_token_id or eos`: a non-zero pad keeps padding recognisable."""


def hf_reference(name: str, seed: int = 0, **overrides):
    """(HF model, Meshline CausalLM with the same weights, ModelConfig); eval mode, fp32."""
    config = get_config(MODELS[name], **overrides)
    if config.family == "bloom":
        hf = BloomForCausalLM._from_config(
            BloomConfig(**hf_config(config)), attn_implementation="eager"
        )
    elif config.family == "llama":
        hf = LlamaForCausalLM._from_config(
            LlamaConfig(**hf_config(config)), attn_implementation="eager"
        )
    else:  # the family's own transformers class (Mistral: sliding window)
        fields = hf_config(config)
        fields.pop("architectures")
        hf_cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in pname or "ln_f" in pname:
                param.copy_((1.0 + 0.2 * noise) if pname.endswith("weight") else 0.1 * noise)
            else:
                # Large weights make the distribution peaked, so greedy/beam ties are unlikely.
                param.copy_(0.3 * noise)
    hf.eval()
    ours = build_model(config, device="cpu").eval()
    ours.load_state_dict(from_hf(hf.state_dict(), config), strict=True)
    return hf, ours, config


def save_hf_checkpoint(hf, directory: Path, tokenizer_model: Path | None = None) -> Path:
    """Write `hf` as an HF checkpoint dir (config.json + model.safetensors [+ tokenizer.model])."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf.config.to_dict()))
    if tokenizer_model is not None:
        (directory / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    return directory


def prompt(length: int, vocab: int, seed: int = 1) -> list[int]:
    """Random prompt ids that avoid the special ids 0-3."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (length,), generator=gen).tolist()


def hf_generate(hf, prompt_ids: list[int], **kwargs) -> torch.Tensor:
    """HF `generate` with no default processors beyond what kwargs ask for."""
    ids = torch.tensor([prompt_ids])
    settings = dict(
        do_sample=False,
        num_beams=1,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        top_k=None,
        top_p=None,
        temperature=None,
        repetition_penalty=None,
        min_length=0,
        use_cache=True,
    )
    settings.update(kwargs)
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), **settings)
