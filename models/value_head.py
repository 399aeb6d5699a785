"""A scalar value head on any registry family: the output head becomes one score per position.

Shapes: B batch, S sequence, E hidden. A reward model is the causal LM with its vocabulary head
replaced by a linear map E → 1 without bias (what transformers' `...ForSequenceClassification`
calls `score`, with `num_labels=1`), so every family the registry builds gains one unchanged:
the forward returns scores [B,S,1], and the pair's reward is the score of its last real token.
The config says so (`ModelConfig.value_head`), so a saved reward model rebuilds with its head
wherever a model is built from a config (checkpoint readers, the converter, HF export).
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.transformer import CausalLM


def attach_value_head(model: CausalLM, seed: int | None = None) -> CausalLM:
    """Replace `model`'s vocabulary head with a fresh scalar head (in place; returns `model`).

    The head is untied from the embedding (a tied head would be the embedding matrix) and drawn
    from N(0, init_std) like every other weight (from `seed` when given).
    """
    config = model.config
    model.config = value_head_config(config)
    reference = model.embed_tokens.weight if model.embed_tokens is not None else None
    head = nn.Linear(config.hidden_size, 1, bias=False)
    if reference is not None:
        head = head.to(device=reference.device, dtype=reference.dtype)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=head.weight.device).manual_seed(seed)
    with torch.no_grad():
        nn.init.normal_(head.weight, mean=0.0, std=config.init_std, generator=generator)
    model.lm_head = head
    return model


def has_value_head(model: nn.Module) -> bool:
    """Whether `model`'s output head is a scalar head (one output feature)."""
    head = getattr(model, "lm_head", None)
    return isinstance(head, nn.Linear) and head.out_features == 1


def value_head_config(config: ModelConfig) -> ModelConfig:
    """`config` with a scalar value head in place of the vocabulary head (untied)."""
    return config.replace(tie_word_embeddings=False, norm_head=False, value_head=True)
