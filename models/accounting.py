"""Parameter counts and FLOPs per token, computed from a `ModelConfig` alone (no model built).

FLOPs per token follow PaLM's 6N + 12·L·H·Q·T (training: forward + backward), where N excludes
the input embedding table (a lookup, not a matmul) unless it is tied to the output head, and the
attention term is counted for the full T×T score matrix — no halving for the causal mask.

Mixture-of-experts models (`config.moe`): each token passes through the router, its K
routed experts and the shared experts only, so N in 6N is the *active* count — the total minus
the (X - K) routed experts per layer that a token skips (`active_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig


@dataclass(frozen=True)
class ParameterBreakdown:
    """Parameter counts of each part of the network."""

    embedding: int
    """Token embedding table (plus the learned position table and embedding layernorm)."""
    per_layer: int
    """One decoder layer."""
    layer_matrices: int
    """Weight-matrix parameters of one layer (tensor-parallel sharded)."""
    final_norm: int
    """Final norm."""
    head: int
    """Output head (0 when tied to the embedding)."""
    routed_experts: int = 0
    """Routed-expert parameters of one MoE layer, all X experts (0 for a dense model)."""
    active_routed_experts: int = 0
    """Routed-expert parameters one token uses in one MoE layer: its K experts."""

    def total(self, num_layers: int) -> int:
        """Whole-model count for `num_layers` layers."""
        return self.embedding + num_layers * self.per_layer + self.final_norm + self.head


def norm_parameters(config: ModelConfig) -> int:
    """Parameters of one norm layer (scale, plus bias for LayerNorm)."""
    return config.hidden_size * (2 if config.norm_type == "layernorm" else 1)


def parameter_breakdown(config: ModelConfig) -> ParameterBreakdown:
    """Exact per-part counts of the CausalLM that `build_model(config)` creates."""
    e, f = config.hidden_size, config.ffn_hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.kv_heads * config.head_dim
    attn_matrices = e * (q + 2 * kv) + q * e
    attn_bias = (q + 2 * kv + e) if config.attention_bias else 0
    if config.qkv_bias and not config.attention_bias:
        attn_bias = q + 2 * kv
    qk_norm = 2 * config.head_dim if config.qk_norm else 0
    branches = 2 if config.gated else 1
    mlp_matrices = branches * e * f + f * e
    mlp_bias = (branches * f + e) if config.mlp_bias else 0
    routed = active = router = 0
    moe_cfg = config.moe
    if moe_cfg is not None:
        # Experts are SwiGLU without biases ([gate; up] and down); shared experts are one dense
        # SwiGLU MLP of width shared_expert_ffn (default F·num_shared_experts); the router is an
        # [X, E] matrix, the optional shared-expert gate a [1, E] one.
        per_expert = 3 * e * f
        routed = moe_cfg.num_experts * per_expert
        active = moe_cfg.top_k * per_expert
        router = moe_cfg.num_experts * e + (e if moe_cfg.shared_expert_gate else 0)
        shared = 0
        if moe_cfg.num_shared_experts:
            shared = 3 * e * (moe_cfg.shared_expert_ffn or f * moe_cfg.num_shared_experts)
        mlp_matrices = routed + shared
        mlp_bias = 0
    matrices = attn_matrices + mlp_matrices
    per_layer = matrices + router + attn_bias + qk_norm + mlp_bias + 2 * norm_parameters(config)
    embedding = config.vocab_size * e
    if config.position_embedding == "learned":
        embedding += config.max_position_embeddings * e  # the position table (GPT)
    if config.embedding_layernorm:
        embedding += norm_parameters(config)
    head = 0 if config.tie_word_embeddings else config.vocab_size * e
    return ParameterBreakdown(
        embedding, per_layer, matrices, norm_parameters(config), head, routed, active
    )


def count_parameters(config: ModelConfig) -> int:
    """Total parameters (a tied embedding/head matrix counted once)."""
    return parameter_breakdown(config).total(config.num_layers)


def active_parameters(config: ModelConfig) -> int:
    """Parameters one token passes through: the total, less the routed experts it is not sent
    to (X - K per MoE layer). Equals `count_parameters` for a dense model."""
    parts = parameter_breakdown(config)
    skipped = parts.routed_experts - parts.active_routed_experts
    return parts.total(config.num_layers) - config.num_layers * skipped


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·H·Q·T (N: active parameters, without the untied input
    embedding)."""
    if seq_len <= 0:
        raise ValueError(f"flops_per_token: seq_len={seq_len} must be positive")
    n = active_parameters(config)
    if not config.tie_word_embeddings:
        n -= config.vocab_size * config.hidden_size
    if config.position_embedding == "learned":
        n -= config.max_position_embeddings * config.hidden_size  # a lookup, no matmul
    attention = 12 * config.num_layers * config.num_attention_heads * config.head_dim * seq_len
    return float(6 * n + attention)


def mfu(tokens_per_second: float, config: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak FLOP/s."""
    if peak_flops <= 0:
        raise ValueError(f"mfu: peak_flops={peak_flops} must be positive")
    return tokens_per_second * flops_per_token(config, seq_len) / peak_flops


def format_count(n: float) -> str:
    """1234567 → '1.23M' (K, M, B, T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
