"""Megatron's architecture flags (`--swiglu`, `--normalization RMSNorm`, ...) as a config section.

A model can be defined by these flags alone, as Megatron/ModelLink scripts do, or chosen with
`--model NAME`, which fills the same `models.config.ModelConfig` fields. Without `--model`, a flag
left out takes Megatron's default (learned absolute positions, LayerNorm, exact-erf GeLU MLP,
biases on every linear, output layer tied to the embedding: the "gpt" family, HF GPT-2); with `--model`, it keeps the registry value, and a flag that contradicts the
registry model (`--model tiny-llama --normalization LayerNorm`) is an error naming both. Shape
flags (`--num-layers`, `--hidden-size`, ...) keep overriding the registry value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from models.config import ModelConfig
from training.config_sections import ModelSection
from training.model_config import pad_vocab

# Megatron's spelling -> ModelConfig value.
NORMALIZATIONS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
POSITION_EMBEDDINGS = {"rope": "rope", "alibi": "alibi", "learned_absolute": "learned"}
# --attention-backend / --use-flash-attn / --triangle-attn -> kernels.attention backend name
# (None: the device's default, i.e. flash-attn on CUDA when installed, npu_fusion_attention on NPU).
ATTENTION_BACKENDS: dict[str, str | None] = {
    "auto": None,
    "flash": "flash",
    "fused": None,
    "unfused": "reference",
    "local": "reference",
    "sdpa": "sdpa",
    "blockwise": "blockwise",
    "npu": "npu",
    "reference": "reference",
}


@dataclass
class ArchSection:
    """Architecture flags of Megatron-LM / ModelLink (model defined without --model)."""

    position_embedding_type: Literal["rope", "alibi", "learned_absolute", "none"] | None = None
    """Position encoding: rope, alibi or learned_absolute (Megatron's default without --model: a
    learned table of --max-position-embeddings rows, the "gpt" family); none is not supported."""
    normalization: Literal["LayerNorm", "RMSNorm"] | None = None
    """Norm layer kind (Megatron's default without --model: LayerNorm)."""
    norm_epsilon: float | None = None
    """Epsilon inside every norm (Megatron's default without --model: 1e-5)."""
    swiglu: bool = False
    """Gated SwiGLU MLP (without it and without --model: GeLU)."""
    no_position_embedding: bool = False
    """Megatron's (deprecated) switch off of the learned position table: accepted with rope or
    alibi, which have none; refused where the model would have one (Megatron's rule)."""
    openai_gelu: bool = False
    """GeLU's tanh approximation (GPT-2's gelu_new) instead of Megatron's default exact erf GeLU."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of one tied to the word embedding."""
    disable_bias_linear: bool = False
    """No biases on the attention and MLP linear layers."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projections only (with --disable-bias-linear)."""
    group_query_attention: bool = False
    """Grouped-query attention with --num-query-groups key/value heads (default 1)."""
    rotary_base: float | None = None
    """RoPE base frequency theta (default 10000)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary (tokenizer size) up to a multiple of this."""
    kv_channels: int | None = None
    """Per-head width (ModelConfig.kv_channels where the models have it, else it must equal
    --hidden-size / --num-attention-heads)."""
    attention_backend: (
        Literal[
            "auto", "flash", "fused", "unfused", "local", "sdpa", "blockwise", "npu", "reference"
        ]
        | None
    ) = None
    """Attention kernel: auto (the device's fastest: on CPU the fused C kernel for causal
    training steps, sdpa for the rest), flash, sdpa, blockwise (ModelLink's --triangle-attn), npu
    or reference; Megatron's fused/unfused/local also accepted."""

    def __post_init__(self) -> None:
        if self.position_embedding_type == "none":
            raise ValueError(
                "--position-embedding-type none is not supported: Meshline models use "
                "--position-embedding-type learned_absolute (GPT, the default), rope (Llama) or "
                "alibi (Bloom)"
            )
        if self.no_position_embedding and self.position_embedding_type == "learned_absolute":
            raise ValueError(
                "--no-position-embedding contradicts --position-embedding-type learned_absolute"
            )
        if self.swiglu and self.openai_gelu:
            raise ValueError("--openai-gelu and --swiglu both choose the MLP activation; keep one")
        if self.norm_epsilon is not None and self.norm_epsilon <= 0:
            raise ValueError(f"--norm-epsilon must be positive, got {self.norm_epsilon}")
        if self.rotary_base is not None and self.rotary_base <= 0:
            raise ValueError(f"--rotary-base must be positive, got {self.rotary_base}")
        if self.make_vocab_size_divisible_by <= 0:
            raise ValueError(
                "--make-vocab-size-divisible-by must be positive, got "
                f"{self.make_vocab_size_divisible_by}"
            )
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise ValueError(f"--kv-channels must be positive, got {self.kv_channels}")

    def kernel_backend(self) -> str | None:
        """The `kernels.attention` backend to force, or None for the device's default."""
        return ATTENTION_BACKENDS[self.attention_backend or "auto"]

    def fields_set(self) -> dict[str, tuple[str, Any]]:
        """ModelConfig fields these flags set: {field: (flag that set it, value)}."""
        out: dict[str, tuple[str, Any]] = {}
        if self.position_embedding_type is not None:
            out["position_embedding"] = (
                f"--position-embedding-type {self.position_embedding_type}",
                POSITION_EMBEDDINGS[self.position_embedding_type],
            )
        if self.normalization is not None:
            out["norm_type"] = (
                f"--normalization {self.normalization}",
                NORMALIZATIONS[self.normalization],
            )
        if self.norm_epsilon is not None:
            out["norm_eps"] = (f"--norm-epsilon {self.norm_epsilon}", self.norm_epsilon)
        if self.swiglu:
            out["activation"] = ("--swiglu", "swiglu")
        if self.openai_gelu:
            out["activation"] = ("--openai-gelu", "gelu")
        if self.untie_embeddings_and_output_weights:
            out["tie_word_embeddings"] = ("--untie-embeddings-and-output-weights", False)
        if self.disable_bias_linear:
            out["attention_bias"] = ("--disable-bias-linear", False)
            out["mlp_bias"] = ("--disable-bias-linear", False)
        if self.rotary_base is not None:
            out["rope_theta"] = (f"--rotary-base {self.rotary_base:g}", float(self.rotary_base))
        if self.add_qkv_bias:
            out.update(_qkv_bias(self.disable_bias_linear))
        if self.kv_channels is not None and "kv_channels" in _model_fields():
            out["kv_channels"] = (f"--kv-channels {self.kv_channels}", self.kv_channels)
        return out


def _model_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(ModelConfig)}


def _qkv_bias(disable_bias_linear: bool) -> dict[str, tuple[str, Any]]:
    if "qkv_bias" in _model_fields():
        return {"qkv_bias": ("--add-qkv-bias", True)}
    if not disable_bias_linear:
        return {"attention_bias": ("--add-qkv-bias", True)}  # all linears have biases anyway
    raise ValueError(
        "--add-qkv-bias with --disable-bias-linear (biases on q/k/v only) is not supported by "
        "this build's models; drop --disable-bias-linear to keep biases on every attention "
        "projection"
    )


# Megatron's defaults for a model given by flags alone (no --model): arguments.py's defaults.
MEGATRON_DEFAULTS: dict[str, Any] = {
    "family": "llama",
    "position_embedding": "learned",
    "norm_type": "layernorm",
    "norm_eps": 1e-5,
    "activation": "gelu_exact",
    "attention_bias": True,
    "mlp_bias": True,
    "tie_word_embeddings": True,
}


def check_against_model(
    name: str, base: ModelConfig, from_flags: dict[str, tuple[str, Any]]
) -> None:
    """ValueError naming both when an architecture flag contradicts the `--model` config."""
    for key, (flag, value) in from_flags.items():
        have = base.head_dim if key == "kv_channels" else getattr(base, key)
        if have != value:
            raise ValueError(
                f"{flag} conflicts with --model {name} (its {key} is {have!r}); "
                f"drop {flag.split()[0]} or choose a model that has it"
            )


def megatron_fields(
    arch: ArchSection, model: ModelSection, tokenizer_vocab: int | None
) -> dict[str, Any]:
    """ModelConfig fields of a model given by Megatron's flags alone (no --model).

    Megatron's defaults for what is left out; the vocabulary is the tokenizer's padded up to
    --make-vocab-size-divisible-by; the FFN width and the position limit default as Megatron's.
    """
    fields = {**MEGATRON_DEFAULTS}
    fields.update({key: value for key, (_, value) in arch.fields_set().items()})
    fields.update(model.overrides())
    if fields["position_embedding"] == "learned":
        if arch.no_position_embedding:
            raise ValueError(
                "--no-position-embedding without --position-embedding-type: Megatron's default "
                "is learned_absolute, which has the table; pass --position-embedding-type rope "
                "or alibi (models without positions are not supported)"
            )
        # Megatron's GPT (pretrain_gpt.py's model): HF GPT-2's layout, the "gpt" family.
        fields["family"] = "gpt"
        fields.setdefault("fused_gate_up", False)
    if "vocab_size" not in fields and tokenizer_vocab is not None:
        fields["vocab_size"] = pad_vocab(tokenizer_vocab, arch.make_vocab_size_divisible_by)
    fields.setdefault("ffn_hidden_size", megatron_ffn_size(fields["hidden_size"], arch.swiglu))
    fields.setdefault("max_position_embeddings", model.seq_length)
    if arch.group_query_attention and model.num_query_groups is None:
        fields["num_kv_heads"] = 1  # Megatron's --num-query-groups default
    fields["extra"] = {"megatron_flags": True}
    return fields


def megatron_ffn_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron's --ffn-hidden-size default: 4h, or 2/3 of that rounded up to 64 with SwiGLU."""
    if not swiglu:
        return 4 * hidden_size
    return -(-int(4 * hidden_size * 2 / 3) // 64) * 64
