"""`MoEConfig`: the typed MoE settings of a model (`ModelConfig.moe`; None = a dense model).

A leaf module (no torch, no other model file) so that `models/config.py` can hold it as a field
and light users (the config registry, `meshline estimate`) skip the kernels. `models/moe.py`
builds the MoE block from it; `models/hf_moe.py` maps it to and from HF `config.json`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_EXPERTS = 2**16
"""Upper bound on experts per layer read from config files (released models have <= 384)."""


@dataclass
class MoEConfig:
    """Experts, routing and auxiliary-loss settings of every MoE layer."""

    num_experts: int = 8
    """Experts X per layer (--num-experts)."""
    top_k: int = 2
    """Experts each token is routed to (--moe-router-topk)."""
    capacity_factor: float | None = None
    """Per-expert capacity = ceil(factor·N·K/X) tokens, extra copies dropped; None = dropless."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss X·Σ f_i·P_i (--moe-aux-loss-coeff)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)²) (--moe-z-loss-coeff)."""
    num_shared_experts: int = 0
    """Dense experts every token also passes through (DeepSeek/Qwen-MoE style); 0 = none."""
    norm_topk_prob: bool = True
    """Renormalise the top-k probabilities to sum to 1 (Mixtral) instead of raw softmax values."""
    shared_expert_ffn: int | None = None
    """Inner width of the shared-expert MLP (Qwen2-MoE shared_expert_intermediate_size); None:
    the expert width times num_shared_experts."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(shared_expert_gate(x)), a [1, E] linear
    (Qwen2-MoE)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "num_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"MoEConfig.{name}={value!r}: must be an integer")
        if self.num_experts > MAX_EXPERTS:
            raise ValueError(
                f"MoEConfig.num_experts={self.num_experts}: more than any real model (at most "
                f"{MAX_EXPERTS}); the config file is corrupted or not trusted"
            )
        if self.num_experts <= 0:
            raise ValueError(f"--num-experts must be positive, got {self.num_experts}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"--moe-router-topk {self.top_k} must be in [1, --num-experts {self.num_experts}]"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"--moe-expert-capacity-factor must be positive, got {self.capacity_factor}"
            )
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.shared_expert_ffn is not None and self.shared_expert_ffn <= 0:
            raise ValueError(f"shared_expert_ffn must be positive, got {self.shared_expert_ffn}")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError("shared_expert_gate needs num_shared_experts >= 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field (inverse of `from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> MoEConfig:
        """Build from `to_dict()` output (or a config.json's "moe" object); a value that is not
        an object, or unknown keys, raise ValueError naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"ModelConfig.moe={data!r}: expected an object of MoEConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown MoEConfig key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**data)
