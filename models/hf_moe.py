"""The MoE fields of HF `config.json` (Mixtral, Qwen2-MoE, Qwen3-MoE) ↔ `MoEConfig`
(`ModelConfig.moe`); used by models/hf_config.py."""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig
from models.families import Family, MoEFacts
from models.moe_config import MoEConfig


def unsupported_field(field: str, value: Any, why: str) -> ValueError:
    """The error for a math-changing config.json field Meshline cannot honour."""
    return ValueError(f"config_from_hf: {field}={value!r} changes the model and {why}")


def moe_fields_from_hf(hf: dict[str, Any], facts: MoEFacts) -> dict[str, Any]:
    """`MoEConfig` fields from an MoE family's config.json (unsupported layouts raise)."""
    experts = hf.get(facts.experts_key, hf.get("num_local_experts", hf.get("num_experts")))
    moe: dict[str, Any] = {"num_experts": experts, "top_k": hf["num_experts_per_tok"]}
    moe["aux_loss_coeff"] = float(hf.get("router_aux_loss_coef", 0.0))
    if facts.renormalises:
        return moe
    if hf.get("mlp_only_layers"):
        raise unsupported_field(
            "mlp_only_layers", hf["mlp_only_layers"], "dense layers are not supported"
        )
    if hf.get("decoder_sparse_step", 1) != 1:
        raise unsupported_field("decoder_sparse_step", hf["decoder_sparse_step"], "must be 1")
    moe["norm_topk_prob"] = bool(hf.get("norm_topk_prob", facts.norm_topk_default))
    shared = hf.get("shared_expert_intermediate_size") if facts.shared_expert else None
    if shared:
        moe.update(num_shared_experts=1, shared_expert_ffn=shared, shared_expert_gate=True)
    return moe


def moe_fields_to_hf(config: ModelConfig, family: Family, moe: MoEConfig) -> dict[str, Any]:
    """The config.json MoE fields of `family` for `moe`; HF-inexpressible settings raise."""
    facts = family.moe
    assert facts is not None, "moe_fields_to_hf needs an MoE family"
    arch = family.hf_architecture
    if moe.capacity_factor is not None:
        raise ValueError(
            f"hf_config: moe capacity_factor={moe.capacity_factor} drops tokens; HF MoE classes "
            "are dropless"
        )
    fields: dict[str, Any] = {
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
    }
    if facts.renormalises:
        if moe.num_shared_experts or not moe.norm_topk_prob:
            raise ValueError(
                f"hf_config: HF {arch} has no shared experts and renormalises the top-k weights; "
                "this MoE config differs (num_shared_experts / norm_topk_prob)"
            )
        return {**fields, facts.experts_key: moe.num_experts}
    shared = moe.num_shared_experts
    if not facts.shared_expert and shared:
        raise ValueError(f"hf_config: HF {arch} has no shared expert (num_shared_experts)")
    if facts.shared_expert and (shared != 1 or not moe.shared_expert_gate):
        raise ValueError(
            f"hf_config: HF {arch} has exactly one gated shared expert (num_shared_experts=1, "
            "shared_expert_gate=True)"
        )
    assert facts.expert_ffn_key is not None
    fields.update(
        {
            facts.experts_key: moe.num_experts,
            facts.expert_ffn_key: config.ffn_hidden_size,
            "intermediate_size": config.extra.get("hf_intermediate_size") or config.ffn_hidden_size,
            "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    )
    if facts.shared_expert:
        fields["shared_expert_intermediate_size"] = moe.shared_expert_ffn or config.ffn_hidden_size
    return fields
