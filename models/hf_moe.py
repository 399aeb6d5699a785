"""The MoE fields of HF `config.json` (Mixtral, Qwen2-MoE, Qwen3-MoE) ↔ `MoEConfig`
(`ModelConfig.moe`); used by models/hf_config.py."""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig
from models.moe_config import MoEConfig


def unsupported_field(field: str, value: Any, why: str) -> ValueError:
    """The error for a math-changing config.json field Meshline cannot honour."""
    return ValueError(f"config_from_hf: {field}={value!r} changes the model and {why}")


def moe_fields_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """`MoEConfig` fields from an MoE family's config.json (unsupported layouts raise)."""
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    moe: dict[str, Any] = {"num_experts": experts, "top_k": hf["num_experts_per_tok"]}
    moe["aux_loss_coeff"] = float(hf.get("router_aux_loss_coef", 0.0))
    if family == "mixtral":
        return moe
    if hf.get("mlp_only_layers"):
        raise unsupported_field(
            "mlp_only_layers", hf["mlp_only_layers"], "dense layers are not supported"
        )
    if hf.get("decoder_sparse_step", 1) != 1:
        raise unsupported_field("decoder_sparse_step", hf["decoder_sparse_step"], "must be 1")
    moe["norm_topk_prob"] = bool(hf.get("norm_topk_prob", family == "qwen3_moe"))
    shared = hf.get("shared_expert_intermediate_size") if family == "qwen2_moe" else None
    if shared:
        moe.update(num_shared_experts=1, shared_expert_ffn=shared, shared_expert_gate=True)
    return moe


def moe_fields_to_hf(config: ModelConfig, family: str, moe: MoEConfig) -> dict[str, Any]:
    """The config.json MoE fields of `family` for `moe`; HF-inexpressible settings raise."""
    if moe.capacity_factor is not None:
        raise ValueError(
            f"hf_config: moe capacity_factor={moe.capacity_factor} drops tokens; HF MoE classes "
            "are dropless"
        )
    fields: dict[str, Any] = {
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
    }
    if family == "mixtral":
        if moe.num_shared_experts or not moe.norm_topk_prob:
            raise ValueError(
                "hf_config: HF Mixtral has no shared experts and renormalises the top-k weights; "
                "this MoE config differs (num_shared_experts / norm_topk_prob)"
            )
        return {**fields, "num_local_experts": moe.num_experts}
    shared = moe.num_shared_experts
    if family == "qwen3_moe" and shared:
        raise ValueError("hf_config: HF Qwen3-MoE has no shared expert (num_shared_experts)")
    if family == "qwen2_moe" and (shared != 1 or not moe.shared_expert_gate):
        raise ValueError(
            "hf_config: HF Qwen2-MoE has exactly one gated shared expert (num_shared_experts=1, "
            "shared_expert_gate=True)"
        )
    fields.update(
        num_experts=moe.num_experts,
        moe_intermediate_size=config.ffn_hidden_size,
        intermediate_size=config.extra.get("hf_intermediate_size") or config.ffn_hidden_size,
        norm_topk_prob=moe.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    if family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = moe.shared_expert_ffn or config.ffn_hidden_size
    return fields
