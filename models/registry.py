"""Named model configurations: the published sizes of each family plus tiny ones for tests.

Llama-3/3.1/3.2, Qwen2.5, Qwen3, Mistral, Mixtral, Qwen1.5-MoE (qwen2_moe), Qwen3-MoE and GPT-2
sizes are those of the published HF `config.json` files.

Names double as CLI choices (`--model llama2-7B`). Sizes follow the released HF `config.json`
files (and ModelLink's launch scripts for llama2-34B and internlm-65B, which have no HF release).
"""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig

_LLAMA1 = dict(family="llama", vocab_size=32000, max_position_embeddings=2048, norm_eps=1e-6)
_LLAMA2 = dict(family="llama", vocab_size=32000, max_position_embeddings=4096, norm_eps=1e-5)
_BAICHUAN = dict(family="baichuan", vocab_size=64000, max_position_embeddings=4096, norm_eps=1e-6)
_BAICHUAN2 = dict(_BAICHUAN, vocab_size=125696, norm_head=True)
_INTERNLM = dict(family="internlm", vocab_size=103168, norm_eps=1e-6, attention_bias=True)
_BLOOM = dict(
    family="bloom",
    vocab_size=250880,
    max_position_embeddings=2048,
    norm_type="layernorm",
    norm_eps=1e-5,
    position_embedding="alibi",
    activation="gelu",
    attention_bias=True,
    mlp_bias=True,
    tie_word_embeddings=True,
    embedding_layernorm=True,
    fused_gate_up=False,
)
_GPT2 = dict(
    family="gpt",
    vocab_size=50257,
    max_position_embeddings=1024,
    norm_type="layernorm",
    norm_eps=1e-5,
    position_embedding="learned",
    activation="gelu",
    attention_bias=True,
    mlp_bias=True,
    tie_word_embeddings=True,
    fused_gate_up=False,
)
"""GPT-2 (HF GPT2LMHeadModel, gelu_new): Megatron's GPT with --openai-gelu."""


def _size(hidden: int, layers: int, heads: int, ffn: int, kv: int | None = None) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        num_kv_heads=kv,
    )


_LLAMA3 = dict(
    family="llama",
    vocab_size=128256,
    max_position_embeddings=8192,
    norm_eps=1e-5,
    rope_theta=500000.0,
)
_LLAMA31_ROPE: dict[str, str | float] = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072, rope_scaling=_LLAMA31_ROPE)
_LLAMA32 = dict(
    _LLAMA31,
    tie_word_embeddings=True,
    rope_scaling={**_LLAMA31_ROPE, "factor": 32.0},
)
_QWEN25 = dict(
    family="qwen2",
    vocab_size=151936,
    max_position_embeddings=32768,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    qkv_bias=True,
)
_QWEN3 = dict(
    family="qwen3",
    vocab_size=151936,
    max_position_embeddings=40960,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    qk_norm=True,
    kv_channels=128,
)
_MISTRAL = dict(
    family="mistral",
    vocab_size=32000,
    max_position_embeddings=32768,
    norm_eps=1e-5,
    sliding_window=4096,
)


def _moe(experts: int, top_k: int, **more: Any) -> dict[str, Any]:
    return {"moe": {"num_experts": experts, "top_k": top_k, **more}}


_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=128,
    max_position_embeddings=128,
)

_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-7B": {**_LLAMA1, **_size(4096, 32, 32, 11008)},
    "llama-13B": {**_LLAMA1, **_size(5120, 40, 40, 13824)},
    "llama-33B": {**_LLAMA1, **_size(6656, 60, 52, 17920)},
    "llama-65B": {**_LLAMA1, **_size(8192, 80, 64, 22016)},
    "llama2-7B": {**_LLAMA2, **_size(4096, 32, 32, 11008)},
    "llama2-13B": {**_LLAMA2, **_size(5120, 40, 40, 13824)},
    "llama2-34B": {**_LLAMA2, **_size(8192, 48, 64, 22016, kv=8)},
    "llama2-70B": {**_LLAMA2, **_size(8192, 80, 64, 28672, kv=8)},
    "baichuan-7B": {**_BAICHUAN, **_size(4096, 32, 32, 11008)},
    "baichuan-13B": {**_BAICHUAN, **_size(5120, 40, 40, 13696), "position_embedding": "alibi"},
    "baichuan2-7B": {**_BAICHUAN2, **_size(4096, 32, 32, 11008)},
    "baichuan2-13B": {**_BAICHUAN2, **_size(5120, 40, 40, 13696), "position_embedding": "alibi"},
    "internlm-7B": {**_INTERNLM, **_size(4096, 32, 32, 11008)},
    "internlm-65B": {**_INTERNLM, **_size(8192, 80, 64, 22016)},
    "aquila-7B": {
        "family": "aquila",
        "vocab_size": 100008,
        "norm_eps": 1e-6,
        **_size(4096, 32, 32, 11008),
    },
    "bloom-7B1": {**_BLOOM, **_size(4096, 30, 32, 16384)},
    "bloom-176B": {**_BLOOM, **_size(14336, 70, 112, 57344)},
    "gpt2-124M": {**_GPT2, **_size(768, 12, 12, 3072)},
    "gpt2-355M": {**_GPT2, **_size(1024, 24, 16, 4096)},
    "gpt2-774M": {**_GPT2, **_size(1280, 36, 20, 5120)},
    "gpt2-1.5B": {**_GPT2, **_size(1600, 48, 25, 6400)},
    "llama3-8B": {**_LLAMA3, **_size(4096, 32, 32, 14336, kv=8)},
    "llama3-70B": {**_LLAMA3, **_size(8192, 80, 64, 28672, kv=8)},
    "llama3.1-8B": {**_LLAMA31, **_size(4096, 32, 32, 14336, kv=8)},
    "llama3.1-70B": {**_LLAMA31, **_size(8192, 80, 64, 28672, kv=8)},
    "llama3.1-405B": {**_LLAMA31, **_size(16384, 126, 128, 53248, kv=8)},
    "llama3.2-1B": {**_LLAMA32, **_size(2048, 16, 32, 8192, kv=8)},
    "llama3.2-3B": {**_LLAMA32, **_size(3072, 28, 24, 8192, kv=8)},
    "qwen2.5-0.5B": {**_QWEN25, **_size(896, 24, 14, 4864, kv=2), "tie_word_embeddings": True},
    "qwen2.5-1.5B": {**_QWEN25, **_size(1536, 28, 12, 8960, kv=2), "tie_word_embeddings": True},
    "qwen2.5-7B": {**_QWEN25, **_size(3584, 28, 28, 18944, kv=4), "vocab_size": 152064},
    "qwen2.5-72B": {**_QWEN25, **_size(8192, 80, 64, 29568, kv=8), "vocab_size": 152064},
    "qwen3-0.6B": {**_QWEN3, **_size(1024, 28, 16, 3072, kv=8), "tie_word_embeddings": True},
    "qwen3-8B": {**_QWEN3, **_size(4096, 36, 32, 12288, kv=8)},
    "qwen3-32B": {**_QWEN3, **_size(5120, 64, 64, 25600, kv=8)},
    "mistral-7B": {**_MISTRAL, **_size(4096, 32, 32, 14336, kv=8)},
    "mixtral-8x7B": {
        **_MISTRAL,
        **_size(4096, 32, 32, 14336, kv=8),
        "family": "mixtral",
        "sliding_window": None,
        "rope_theta": 1000000.0,
        **_moe(8, 2),
    },
    "qwen1.5-moe-A2.7B": {
        **_QWEN25,
        **_size(2048, 24, 16, 1408),
        "family": "qwen2_moe",
        "max_position_embeddings": 8192,
        **_moe(
            60,
            4,
            norm_topk_prob=False,
            num_shared_experts=1,
            shared_expert_ffn=5632,
            shared_expert_gate=True,
        ),
    },
    "qwen3-30B-A3B": {
        **_QWEN3,
        **_size(2048, 48, 32, 768, kv=4),
        "family": "qwen3_moe",
        **_moe(128, 8),
    },
    "tiny-llama": {"family": "llama", **_TINY},
    "tiny-llama-gqa": {"family": "llama", **_TINY, "num_kv_heads": 2},
    "tiny-bloom": {
        **_BLOOM,
        **_TINY,
        "ffn_hidden_size": 256,
    },
    "tiny-gpt": {**_GPT2, **_TINY, "ffn_hidden_size": 256},
    "tiny-baichuan": {"family": "baichuan", **_TINY},
    "tiny-baichuan-alibi": {"family": "baichuan", **_TINY, "position_embedding": "alibi"},
    "tiny-internlm": {**_INTERNLM, **_TINY},
    # Mixtral-style MoE (issue #10): a Llama config whose layers are MoE (`moe`); HF Mixtral.
    "tiny-mixtral": {
        "family": "llama",
        **_TINY,
        "num_kv_heads": 2,
        "ffn_hidden_size": 96,
        **_moe(4, 2),
    },
    # Issue #18 families, tiny: prompts of 24+ tokens pass the window and the original context.
    "tiny-llama3": {
        "family": "llama",
        **_TINY,
        "num_kv_heads": 2,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA31_ROPE, "original_max_position_embeddings": 16},
    },
    "tiny-qwen2": {**_QWEN25, **_TINY, "num_kv_heads": 2},
    "tiny-qwen3": {**_QWEN3, **_TINY, "num_kv_heads": 2, "kv_channels": 32},
    "tiny-mistral": {**_MISTRAL, **_TINY, "num_kv_heads": 2, "sliding_window": 8},
    "tiny-mixtral-hf": {
        **_MISTRAL,
        **_TINY,
        "family": "mixtral",
        "num_kv_heads": 2,
        "ffn_hidden_size": 96,
        "sliding_window": 8,
        **_moe(4, 2),
    },
    "tiny-qwen2-moe": {
        **_QWEN25,
        **_TINY,
        "family": "qwen2_moe",
        "num_kv_heads": 2,
        "ffn_hidden_size": 32,
        **_moe(
            4,
            2,
            norm_topk_prob=False,
            num_shared_experts=1,
            shared_expert_ffn=48,
            shared_expert_gate=True,
        ),
    },
    "tiny-qwen3-moe": {
        **_QWEN3,
        **_TINY,
        "family": "qwen3_moe",
        "num_kv_heads": 2,
        "kv_channels": 32,
        "ffn_hidden_size": 32,
        **_moe(4, 2),
    },
}


def list_configs() -> list[str]:
    """Every registered name, in registry order."""
    return list(_CONFIGS)


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The named configuration with `overrides` applied (validated; unknown names raise)."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known configs: {', '.join(_CONFIGS)}")
    fields = dict(_CONFIGS[name])
    fields["extra"] = {**fields.get("extra", {}), "registry_name": name}
    fields.update(overrides)
    unknown = sorted(set(fields) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"get_config({name!r}): unknown override(s) {unknown}; "
            f"known fields: {sorted(ModelConfig.__dataclass_fields__)}"
        )
    return ModelConfig(**fields)
