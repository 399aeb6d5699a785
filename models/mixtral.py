"""Mixtral-style family: the generic decoder with every MLP replaced by an MoE block.

A config is an MoE model when `config.extra["moe"]` holds `MoEConfig` fields (the registry's
`tiny-mixtral` does); `build_causal_lm` builds either kind, so callers need not care. Parameter
names equal HF `MixtralForCausalLM`'s without the `model.` prefix, so the generic
`models.hf_adapters.to_hf` / `from_hf` convert the weights (with `fused_qkv=False` they are a pure
rename); `mixtral_hf_config` writes the matching `config.json`.
"""

from __future__ import annotations

from typing import Any

import torch

from models.config import ModelConfig
from models.moe import MoEConfig
from models.transformer import CausalLM, build_model


def moe_config(config: ModelConfig) -> MoEConfig | None:
    """The MoE settings of `config` (None for a dense model)."""
    fields = config.extra.get("moe")
    return None if fields is None else MoEConfig(**fields)


def build_causal_lm(
    config: ModelConfig,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """`build_model`, which builds MoE feed-forwards itself when `config.extra["moe"]` is set.

    Like `build_model`: on "meta" nothing is allocated (then `to_empty` + `init_weights`).
    """
    moe_config(config)  # validates the MoE settings
    return build_model(config, device=device, dtype=dtype)


def mixtral_hf_config(config: ModelConfig) -> dict[str, Any]:
    """HF `MixtralConfig` fields describing `config` (an MoE Llama-style config)."""
    from models.hf_adapters import hf_config

    if moe_config(config) is None:
        raise ValueError("mixtral_hf_config: config.extra has no 'moe' settings")
    family = config.family if config.family == "mixtral" else "llama"
    return hf_config(config.replace(family=family))
