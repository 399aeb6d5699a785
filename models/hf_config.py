"""HF `config.json` ↔ `ModelConfig`, in both directions, for every supported family.

Every field of a family's config.json that changes the math is read into a `ModelConfig` field (or
the typed `moe` field for MoE families) and written back by `hf_config`; a math-changing value Meshline
cannot honour raises ValueError naming the field. RoPE parameters are read from transformers 5's
`rope_parameters` or 4.x's `rope_scaling` (+ `rope_theta`) and written in 5's spelling. Fields
that do not change the math but that an export needs (bos/eos/pad token ids) travel in
`extra["hf_tokens"]`, so HF → native → HF keeps them.
"""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig
from models.families import (
    FAMILY_FACTS,
    MOE_EXPORT_FAMILY,
    Family,
    family_facts,
    family_of_model_type,
)
from models.hf_gpt2 import config_from_gpt2, gpt2_config
from models.hf_moe import moe_fields_from_hf, moe_fields_to_hf, unsupported_field

CAUSAL_LM, SEQ_CLS = "ForCausalLM", "ForSequenceClassification"
"""Suffixes of transformers' class names: a causal LM, and the same body with a `score` head."""

HF_ARCH: dict[str, tuple[str, str]] = {
    name: (facts.hf_architecture, facts.hf_model_type) for name, facts in FAMILY_FACTS.items()
}
"""Family → (HF architecture, model_type), from models/families.py."""
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_ROPE_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, ModelConfig.rope_scaling) from either spelling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        raise unsupported_field("rope_parameters", params, "per-layer-type RoPE is not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise unsupported_field("partial_rotary_factor", params.get("partial_rotary_factor"), "")
    if kind == "default":
        return theta, None
    if kind not in ("linear", "dynamic", "llama3", "yarn"):
        raise unsupported_field("rope_parameters.rope_type", kind, "Meshline has no such RoPE")
    scaling: dict[str, Any] = {"type": kind}
    scaling.update({k: params[k] for k in _ROPE_KEYS if params.get(k) is not None})
    if kind == "dynamic":
        # transformers' dynamic NTK grows past max_position_embeddings and ignores any other key.
        scaling["original_max_position_embeddings"] = hf["max_position_embeddings"]
    if kind == "yarn" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = hf["max_position_embeddings"]
    if kind == "yarn" and "factor" not in scaling:
        scaling["factor"] = (
            hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
        )
    return theta, scaling


def _window(hf: dict[str, Any], facts: Family) -> int | None:
    """The sliding window all layers share, or None; per-layer mixes raise."""
    window = hf.get("sliding_window")
    layers = hf["num_hidden_layers"]
    if facts.window == "mistral":
        return window or None
    types = hf.get("layer_types")
    if types is None:
        if not hf.get("use_sliding_window", False) or not window:
            return None
        first = hf.get("max_window_layers", layers)
        types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if set(types) == {"full_attention"}:
        return None
    if set(types) == {"sliding_attention"} and window:
        return int(window)
    raise unsupported_field(
        "layer_types", types, "mixes sliding and full attention per layer (not supported)"
    )


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """A ModelConfig from an HF `config.json` dict (any family of HF_ARCH; a
    `...ForSequenceClassification` with one label is a reward model: `value_head`)."""
    architectures = hf.get("architectures") or [""]
    arch = str(architectures[0])
    if arch.endswith(SEQ_CLS):
        return _reward_config_from_hf(hf, arch, overrides)
    model_type = str(hf.get("model_type"))
    family = family_of_model_type(model_type)
    if family is None:
        raise ValueError(
            f"config_from_hf: model_type {model_type!r} is not supported; expected one of "
            f"{sorted(mt for _, mt in HF_ARCH.values())}"
        )
    tokens = {k: hf[k] for k in TOKEN_KEYS if hf.get(k) is not None}
    extra: dict[str, Any] = {"hf_tokens": tokens} if tokens else {}
    facts = family_facts(family)
    if facts.layout == "gpt2":
        return ModelConfig(**{**config_from_gpt2(hf, extra), **overrides})
    if facts.layout == "bloom":
        fields = _bloom_fields(hf, family, extra)
    else:
        fields = _llama_style_fields(hf, family, facts, extra)
    fields.update(overrides)
    return ModelConfig(**fields)


def _reward_config_from_hf(hf: dict[str, Any], arch: str, overrides: dict[str, Any]) -> ModelConfig:
    """A one-label `...ForSequenceClassification`: its causal body with a value head."""
    labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))
    if labels != 1:
        raise unsupported_field(
            "id2label", labels, "has more than one label; only a scalar reward head reads"
        )
    causal = {**hf, "architectures": [arch.removesuffix(SEQ_CLS) + CAUSAL_LM]}
    causal["tie_word_embeddings"] = False
    own = config_from_hf(causal, **overrides)
    return own.replace(tie_word_embeddings=False, norm_head=False, value_head=True)


def _bloom_fields(hf: dict[str, Any], family: str, extra: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a BLOOM config (ALiBi, LayerNorm, GELU, biases everywhere)."""
    if hf.get("apply_residual_connection_post_layernorm"):
        raise unsupported_field(
            "apply_residual_connection_post_layernorm", True, "is not supported"
        )
    hidden = hf["hidden_size"]
    return dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["n_layer"],
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=4 * hidden,
        norm_type="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        position_embedding="alibi",
        activation="gelu",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        embedding_layernorm=True,
        fused_gate_up=False,
        init_std=hf.get("initializer_range", 0.02),
        extra=extra,
    )


def _llama_style_fields(
    hf: dict[str, Any], family: str, facts: Family, extra: dict[str, Any]
) -> dict[str, Any]:
    """ModelConfig fields of a Llama-layout config (SwiGLU, RMSNorm, RoPE or Baichuan's ALiBi,
    optional MoE); `extra` gains the HF intermediate size of an MoE family that has one."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise unsupported_field(
            "hidden_act", act, "only silu (SwiGLU) is supported for this family"
        )
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim")
    derived = hf["hidden_size"] // heads
    # Baichuan picks ALiBi by size in its remote code: the 13B models (hidden 5120) use it.
    # Exports of other sizes say so in "position_embedding" (ignored by the remote code).
    alibi = facts.remote_code_choices and (
        hf.get("position_embedding", "alibi" if hf["hidden_size"] == 5120 else "rope") == "alibi"
    )
    moe = moe_fields_from_hf(hf, facts.moe) if facts.moe is not None else None
    ffn = None
    if facts.moe is not None and facts.moe.expert_ffn_key is not None:
        extra["hf_intermediate_size"] = hf.get("intermediate_size")
        ffn = hf[facts.moe.expert_ffn_key]
    return dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=None if kv == heads else kv,
        kv_channels=None if head_dim in (None, derived) else head_dim,
        ffn_hidden_size=ffn or hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", hf.get("model_max_length", 2048)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        position_embedding="alibi" if alibi else "rope",
        rope_theta=theta,
        rope_scaling=None if alibi else scaling,
        attention_bias=bool(hf.get("attention_bias", hf.get("bias", False))),
        qkv_bias=facts.qkv_bias and bool(hf.get("qkv_bias", True)),
        qk_norm=facts.qk_norm,
        sliding_window=_window(hf, facts),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        norm_head=facts.remote_code_choices and hf.get("norm_head", hf["vocab_size"] == 125696),
        init_std=hf.get("initializer_range", 0.02),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        moe=moe,
        extra=extra,
    )


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is None:
        return rope
    kind = config.rope_scaling["type"]
    if kind == "ntk":
        raise ValueError(
            f"hf_config: rope_scaling {config.rope_scaling!r} (static NTK) has no HF equivalent; "
            "HF's 'dynamic' NTK changes with the sequence length"
        )
    rope["rope_type"] = kind
    for key, value in config.rope_scaling.items():
        if key != "type":
            rope[key] = float(value) if key == "factor" else value
    if kind == "dynamic":
        original = rope.pop("original_max_position_embeddings")
        if original != config.max_position_embeddings:
            raise ValueError(
                f"hf_config: dynamic rope_scaling original_max_position_embeddings={original} must "
                f"equal max_position_embeddings={config.max_position_embeddings} (HF grows from it)"
            )
    return rope


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` content that describes `config`'s network (and its token ids); a
    value head is written as transformers' `...ForSequenceClassification` with one label."""
    if config.value_head:
        return _value_head_hf_config(config)
    family = config.family
    facts = family_facts(family)
    if config.moe is not None and facts.moe is None:
        family = MOE_EXPORT_FAMILY  # a Llama-style config with MoE layers (tiny-mixtral)
        facts = family_facts(family)
    arch, model_type = facts.hf_architecture, facts.hf_model_type
    common: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_word_embeddings,
        **config.extra.get("hf_tokens", {}),
    }
    if facts.layout == "gpt2":
        return gpt2_config(config, common)
    if facts.layout == "bloom":
        return {
            **common,
            "n_layer": config.num_layers,
            "n_head": config.num_attention_heads,
            "layer_norm_epsilon": config.norm_eps,
            "apply_residual_connection_post_layernorm": False,
            "hidden_dropout": config.hidden_dropout,
            "attention_dropout": config.attention_dropout,
        }
    return _llama_style_hf_config(config, facts, common)


def _value_head_hf_config(config: ModelConfig) -> dict[str, Any]:
    out = hf_config(config.replace(value_head=False))
    arch = out["architectures"][0]
    if not arch.endswith(CAUSAL_LM):
        raise ValueError(
            f"hf_config: family {config.family!r} ({arch}) has no known sequence-"
            "classification class to hold a value head"
        )
    out["architectures"] = [arch.removesuffix(CAUSAL_LM) + SEQ_CLS]
    out["id2label"], out["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return out


def _llama_style_hf_config(
    config: ModelConfig, facts: Family, common: dict[str, Any]
) -> dict[str, Any]:
    """A Llama-layout family's config.json, each family-specific key as its facts say."""
    _check_expressible(config, facts)
    out: dict[str, Any] = {
        **common,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "attention_dropout": config.attention_dropout,
    }
    if config.position_embedding == "rope":
        out["rope_theta"] = config.rope_theta
        out["rope_parameters"] = _rope_parameters(config)
    if facts.attention_bias_key:
        out["attention_bias"] = config.attention_bias
    if facts.llama_bias_keys:
        out["bias"] = config.attention_bias
        out["mlp_bias"] = config.mlp_bias
    if facts.remote_code_choices:
        # Baichuan's remote code decides ALiBi by size and NormHead by version; say it outright.
        out["position_embedding"] = config.position_embedding
        out["norm_head"] = config.norm_head
        out["model_max_length"] = config.max_position_embeddings
    out.update(_window_keys(config, facts))
    if facts.qkv_bias_key:
        out["qkv_bias"] = config.qkv_bias
    if config.moe is not None:
        out.update(moe_fields_to_hf(config, facts, config.moe))
    return out


def _window_keys(config: ModelConfig, facts: Family) -> dict[str, Any]:
    """The sliding-window keys in the family's spelling (Qwen's per-layer types, Mistral's)."""
    out: dict[str, Any] = {}
    if facts.window == "qwen":
        windowed = config.sliding_window is not None
        out["use_sliding_window"] = windowed
        if windowed:
            out["sliding_window"] = config.sliding_window
        out["max_window_layers"] = 0 if windowed else config.num_layers
        kind = "sliding_attention" if windowed else "full_attention"
        out["layer_types"] = [kind] * config.num_layers
    if facts.window == "mistral":
        out["sliding_window"] = config.sliding_window
    return out


def _check_expressible(config: ModelConfig, facts: Family) -> None:
    """Raise ValueError naming the field the family's HF class cannot express."""
    bad: list[str] = []
    if config.activation != "swiglu":
        bad.append(f"activation={config.activation!r}")
    if config.position_embedding != "rope" and not facts.remote_code_choices:
        bad.append(f"position_embedding={config.position_embedding!r}")
    if config.qkv_bias and not facts.qkv_bias:
        bad.append("qkv_bias=True")
    if facts.qkv_bias and (config.attention_bias or not config.qkv_bias):
        bad.append(f"attention_bias={config.attention_bias}, qkv_bias={config.qkv_bias}")
    if config.qk_norm != facts.qk_norm:
        bad.append(f"qk_norm={config.qk_norm}")
    if config.sliding_window is not None and facts.window is None:
        bad.append(f"sliding_window={config.sliding_window}")
    if config.attention_bias and not facts.attention_bias_key:
        bad.append("attention_bias=True")
    if config.mlp_bias and not facts.llama_bias_keys:
        bad.append("mlp_bias=True")
    if config.norm_head and not facts.remote_code_choices:
        bad.append("norm_head=True")
    if config.embedding_layernorm or config.norm_type != "rmsnorm":
        bad.append(
            f"norm_type={config.norm_type!r}, embedding_layernorm={config.embedding_layernorm}"
        )
    if bad:
        raise ValueError(
            f"hf_config: {', '.join(bad)} cannot be expressed by HF {facts.hf_architecture} "
            f"(family {config.family!r}); pick the family whose HF class has it"
        )
