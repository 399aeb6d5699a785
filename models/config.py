"""`ModelConfig`: the typed description of one decoder-only network.

One generic decoder covers the Llama family (Llama 1/2/3, Baichuan 1/2, InternLM, Aquila),
Qwen2/2.5/3, Mistral, the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE: the typed `moe` field,
`models/moe_config.py`), Bloom and Megatron's GPT (HF GPT-2) through these options; `models/registry.py` holds the named
configurations. Every field has a default and a one-line docstring; a config is validated when
built (`ValueError` naming the field), and `to_dict()` / `from_dict()` round-trip through JSON
(`from_dict` also reads files written before `moe` was a field, which carried `extra["moe"]`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from models.moe_config import MoEConfig

FAMILIES = (
    "llama",
    "baichuan",
    "internlm",
    "aquila",
    "bloom",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt",
)
NORM_TYPES = ("rmsnorm", "layernorm")
POSITION_EMBEDDINGS = ("rope", "alibi", "learned")
ACTIVATIONS = ("swiglu", "geglu", "gelu", "gelu_exact")
ROPE_SCALING_TYPES = ("linear", "ntk", "dynamic", "llama3", "yarn")
"""RoPE scalings (kernels/rotary.py): HF's rope_type names plus Meshline's static "ntk"."""


MAX_SIZES: dict[str, int] = {
    "vocab_size": 2**22,
    "hidden_size": 2**17,
    "num_layers": 2048,
    "num_attention_heads": 2048,
    "ffn_hidden_size": 2**20,
    "max_position_embeddings": 2**24,
}
"""Upper bounds on sizes read from config files: far above any released model, low enough that
a hostile config.json cannot make a reader build per-layer tables of absurd length."""


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a causal decoder (no parallel layout, no training)."""

    family: str = "llama"
    """Model family: selects the HF adapter and TP plan (one of FAMILIES)."""
    vocab_size: int = 32000
    """Rows of the token embedding and of the output head."""
    hidden_size: int = 4096
    """Width E of the residual stream."""
    num_layers: int = 32
    """Number of decoder layers L."""
    num_attention_heads: int = 32
    """Query heads H; hidden_size must be a multiple of it."""
    num_kv_heads: int | None = None
    """Key/value heads K (GQA/MQA when fewer than H); None means K = H."""
    ffn_hidden_size: int = 11008
    """Inner width of the MLP (per branch for gated activations)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is meant for (KV-cache default length, RoPE tables)."""
    norm_type: str = "rmsnorm"
    """"rmsnorm" (Llama family) or "layernorm" (Bloom)."""
    norm_eps: float = 1e-6
    """Epsilon added to the variance inside every norm."""
    position_embedding: str = "rope"
    """"rope" (rotary, half-rotation layout), "alibi" (linear attention biases) or "learned" (a
    trained absolute-position table added to the token embeddings: GPT-2, Megatron's default
    learned_absolute; at most max_position_embeddings tokens)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """Optional RoPE scaling {"type": one of ROPE_SCALING_TYPES, "factor": >= 1, ...}: "llama3"
    also reads low_freq_factor, high_freq_factor, original_max_position_embeddings; "yarn"
    reads beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate,
    original_max_position_embeddings; "dynamic" original_max_position_embeddings (HF's names)."""
    activation: str = "swiglu"
    """MLP activation: "swiglu", "geglu" (gated, gate_proj + up_proj), "gelu" (tanh approximation:
    HF gelu_new, Bloom, Megatron --openai-gelu) or "gelu_exact" (erf: Megatron's default, HF
    "gelu")."""
    attention_bias: bool = False
    """Biases on the q/k/v/o projections (InternLM, Bloom)."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections only, none on o_proj (Qwen2, Qwen2-MoE; Megatron
    --add-qkv-bias)."""
    kv_channels: int | None = None
    """Per-head width D when it is not hidden_size / num_attention_heads (Qwen3's explicit
    head_dim; Megatron --kv-channels); None derives it."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3 q_norm/k_norm; Megatron
    --qk-layernorm)."""
    sliding_window: int | None = None
    """Each query sees only the last `sliding_window` keys, itself included (Mistral; HF
    sliding_window), in training, prefill and decode; None = full causal attention."""
    mlp_bias: bool = False
    """Biases on the MLP projections (Bloom)."""
    tie_word_embeddings: bool = False
    """Output head shares the token-embedding matrix."""
    embedding_layernorm: bool = False
    """Normalise token embeddings before the first layer (Bloom's word_embeddings_layernorm)."""
    norm_head: bool = False
    """L2-normalise the output head's rows before the logits (Baichuan2's NormHead)."""
    value_head: bool = False
    """The output head is a scalar value head (a reward model): `lm_head` maps the hidden state to
    one score per position (transformers' `...ForSequenceClassification.score`, num_labels=1),
    untied from the embedding (models/value_head.py)."""
    fused_qkv: bool = True
    """One qkv_proj GEMM laid out [q; k; v] instead of q_proj, k_proj, v_proj."""
    fused_gate_up: bool = True
    """One gate_up_proj GEMM laid out [gate; up] instead of gate_proj, up_proj (gated only)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix."""
    attention_dropout: float = 0.0
    """Dropout probability on attention probabilities (training only)."""
    hidden_dropout: float = 0.0
    """Dropout probability on each residual branch output (training only)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts settings: every layer's MLP is an MoE block (Mixtral, Qwen-MoE); None =
    dense. A dict of `MoEConfig` fields is accepted and converted."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-safe metadata (e.g. the HF architecture name); never read by the model."""

    def __post_init__(self) -> None:
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            self.moe = MoEConfig.from_dict(self.moe)
        self.validate()

    @property
    def kv_heads(self) -> int:
        """Key/value heads K (num_kv_heads, or H when unset)."""
        return self.num_attention_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Per-head width D: kv_channels, else hidden_size / num_attention_heads."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def context_length(self) -> int:
        """Longest sequence to serve: max_position_embeddings, times the factor under "dynamic"
        RoPE scaling (whose max_position_embeddings is the pre-training length, as in HF)."""
        scaling = self.rope_scaling or {}
        if scaling.get("type") == "dynamic":
            return int(self.max_position_embeddings * float(scaling["factor"]))
        return self.max_position_embeddings

    @property
    def gated(self) -> bool:
        """True when the MLP has a gate branch (swiglu, geglu)."""
        return self.activation in ("swiglu", "geglu")

    def validate(self) -> None:
        """Raise ValueError naming the field when the configuration cannot describe a network."""
        self._check_kinds()
        self._check_sizes()
        self._check_shapes()
        for name in ("norm_eps", "rope_theta", "init_std"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: must be positive")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: must be in [0, 1)")
        if self.rope_scaling is not None:
            self._check_rope_scaling(self.rope_scaling)

    def _check_kinds(self) -> None:
        """The family, extra, value head and every named choice."""
        _choice("family", self.family, FAMILIES)
        if not isinstance(self.extra, dict):
            raise ValueError(f"ModelConfig.extra={self.extra!r}: must be an object")
        if "moe" in self.extra:
            raise ValueError(
                'ModelConfig.extra["moe"] is no longer read: pass the MoE settings as '
                "ModelConfig(moe=MoEConfig(...)) (ModelConfig.from_dict converts old files)"
            )
        if self.value_head and (self.tie_word_embeddings or self.norm_head):
            raise ValueError(
                "ModelConfig: a value head (value_head=True) is a [1, hidden] matrix of its own; "
                "it cannot be tied to the embedding or row-normalised (set tie_word_embeddings "
                "and norm_head to False)"
            )
        _choice("norm_type", self.norm_type, NORM_TYPES)
        _choice("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        _choice("activation", self.activation, ACTIVATIONS)

    def _check_sizes(self) -> None:
        """Every size a positive integer no larger than a real model's."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "ffn_hidden_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r}: must be a positive integer")
            if value > MAX_SIZES[name]:
                raise ValueError(
                    f"ModelConfig.{name}={value}: larger than any real model (at most "
                    f"{MAX_SIZES[name]}); the config file is corrupted or not trusted"
                )
        if self.kv_channels is not None and (
            not isinstance(self.kv_channels, int) or self.kv_channels <= 0
        ):
            raise ValueError(f"ModelConfig.kv_channels={self.kv_channels!r}: must be positive")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"ModelConfig.sliding_window={self.sliding_window!r}: must be a positive integer "
                "or None (full attention)"
            )

    def _check_shapes(self) -> None:
        """Heads divide the hidden size and the query heads; RoPE has an even head_dim."""
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick sizes with an integer head_dim"
            )
        if self.num_kv_heads is not None and (
            self.num_kv_heads <= 0 or self.num_attention_heads % self.num_kv_heads
        ):
            raise ValueError(
                f"ModelConfig.num_kv_heads={self.num_kv_heads}: must be a positive divisor of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim}: RoPE needs an even head_dim")

    def _check_rope_scaling(self, scaling: dict[str, Any]) -> None:
        kind = scaling.get("type")
        factor = scaling.get("factor")
        if kind not in ROPE_SCALING_TYPES or not isinstance(factor, (int, float)) or factor < 1:
            raise ValueError(
                f"ModelConfig.rope_scaling={scaling!r}: expected "
                f'{{"type": one of {ROPE_SCALING_TYPES}, "factor": a number >= 1}}'
            )
        # kernels.rotary loads torch: a config is read and checked without it until here
        from kernels.rotary import RopeScaling

        try:
            RopeScaling.from_dict(scaling)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"ModelConfig.rope_scaling={scaling!r}: {exc}") from exc
        if self.position_embedding != "rope":
            raise ValueError("ModelConfig.rope_scaling is set but position_embedding is not 'rope'")

    def replace(self, **overrides: Any) -> ModelConfig:
        """A validated copy with some fields changed (unknown names raise ValueError)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}"
            )
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field (inverse of `from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from `to_dict()` output; unknown keys raise ValueError naming them.

        Files written before `moe` was a field carry the MoE settings as `extra["moe"]`; they are
        moved to `moe` (both at once is ambiguous and raises).
        """
        if not isinstance(data, dict):
            raise ValueError(
                f"ModelConfig: expected an object of fields, got {type(data).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig key(s) {unknown}; known keys: {sorted(known)}")
        extra = data.get("extra")
        if isinstance(extra, dict) and "moe" in extra:
            if data.get("moe") is not None:
                raise ValueError(
                    'ModelConfig: both "moe" and the older extra["moe"] are set; keep "moe"'
                )
            legacy = {k: v for k, v in extra.items() if k != "moe"}
            data = {**data, "extra": legacy, "moe": extra["moe"]}
        return cls(**data)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"ModelConfig.{name}={value!r}: expected one of {list(choices)}")
