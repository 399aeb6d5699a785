"""Family facts as data: one row per family, read by the HF mapping (config.json both ways,
state-dict names), the MoE mapping and LoRA naming, instead of `family in (...)` tests in each.

A row says how the family's HF checkpoints look (architecture, model_type, tensor naming, which
config.json keys exist) and which `ModelConfig` options its HF class can express. Adding a family
is adding a row (and, for a new tensor naming, a layout in models/hf_adapters.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class MoEFacts:
    """How an MoE family's config.json and checkpoints describe the experts."""

    experts_key: str
    """config.json key of the expert count (Mixtral num_local_experts, Qwen num_experts)."""
    block: str
    """Module holding the router and the per-expert tensors on disk (block_sparse_moe, mlp)."""
    expert_names: dict[str, str] = field(default_factory=dict)
    """On-disk names of an expert's gate/up/down projections where they are not those (Mixtral
    w1/w3/w2)."""
    expert_ffn_key: str | None = None
    """config.json key of the expert width when it is not intermediate_size (Qwen)."""
    renormalises: bool = False
    """Always renormalises the top-k weights and has no norm_topk_prob key (Mixtral)."""
    norm_topk_default: bool = True
    """norm_topk_prob when config.json leaves it out."""
    shared_expert: bool = False
    """Has exactly one gated shared expert (Qwen2-MoE's shared_expert_intermediate_size)."""


MIXTRAL_MOE = MoEFacts(
    experts_key="num_local_experts",
    block="block_sparse_moe",
    expert_names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    renormalises=True,
)


@dataclass(frozen=True)
class Family:
    """What one family's HF checkpoints look like and which options its HF class expresses."""

    hf_architecture: str
    """`architectures[0]` of its config.json."""
    hf_model_type: str
    """`model_type` of its config.json."""
    layout: Literal["llama", "bloom", "gpt2"] = "llama"
    """Tensor naming: Llama's `model.layers.i` (Qwen, Mistral, Baichuan...), Bloom's
    `transformer.h.i` or GPT-2's (Conv1D) `transformer.h.i` (models/hf_adapters.py)."""
    packed_qkv: str | None = None
    """HF module holding [q; k; v] as one tensor in the Llama layout (Baichuan's W_pack)."""
    attention_bias_key: bool = False
    """config.json has attention_bias: the HF class can put biases on q/k/v/o."""
    llama_bias_keys: bool = False
    """config.json has Llama's bias and mlp_bias keys: MLP biases are expressible."""
    qkv_bias: bool = False
    """The HF class has q/k/v biases and none on o (Qwen2; config.json's qkv_bias key, default
    true, where the class reads it)."""
    qkv_bias_key: bool = False
    """config.json carries qkv_bias explicitly (Qwen2-MoE)."""
    qk_norm: bool = False
    """The HF class RMS-normalises each head's q and k (Qwen3)."""
    window: Literal["mistral", "qwen"] | None = None
    """How config.json states a sliding window: Mistral's sliding_window alone, or Qwen's
    use_sliding_window / max_window_layers / layer_types; None: no window."""
    remote_code_choices: bool = False
    """Baichuan's remote code picks ALiBi by size and NormHead by version: config.json states
    position_embedding, norm_head and model_max_length outright (ALiBi and NormHead allowed)."""
    moe: MoEFacts | None = None
    """The MoE layout; None: a dense family."""
    fused_lora_qkv: bool = False
    """HF keeps q/k/v in one module, so a LoRA on q, k or v alone has no HF name."""


FAMILY_FACTS: dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM", "llama", attention_bias_key=True, llama_bias_keys=True, moe=None
    ),
    "internlm": Family(
        "InternLMForCausalLM", "internlm", attention_bias_key=True, llama_bias_keys=True
    ),
    "aquila": Family("AquilaForCausalLM", "aquila", attention_bias_key=True, llama_bias_keys=True),
    "baichuan": Family(
        "BaichuanForCausalLM",
        "baichuan",
        packed_qkv="W_pack",
        attention_bias_key=True,
        llama_bias_keys=True,
        remote_code_choices=True,
        fused_lora_qkv=True,
    ),
    "bloom": Family("BloomForCausalLM", "bloom", layout="bloom", fused_lora_qkv=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, window="qwen"),
    "qwen3": Family(
        "Qwen3ForCausalLM", "qwen3", attention_bias_key=True, qk_norm=True, window="qwen"
    ),
    "mistral": Family("MistralForCausalLM", "mistral", window="mistral"),
    "mixtral": Family("MixtralForCausalLM", "mixtral", window="mistral", moe=MIXTRAL_MOE),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        qkv_bias=True,
        qkv_bias_key=True,
        window="qwen",
        moe=MoEFacts(
            experts_key="num_experts",
            block="mlp",
            expert_ffn_key="moe_intermediate_size",
            norm_topk_default=False,
            shared_expert=True,
        ),
    ),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        attention_bias_key=True,
        qk_norm=True,
        window="qwen",
        moe=MoEFacts(
            experts_key="num_experts", block="mlp", expert_ffn_key="moe_intermediate_size"
        ),
    ),
    "gpt": Family("GPT2LMHeadModel", "gpt2", layout="gpt2", fused_lora_qkv=True),
}
"""Every family of `models.config.FAMILIES`, by name."""

MOE_EXPORT_FAMILY = "mixtral"
"""The HF class an MoE config of a dense family (tiny-mixtral: Llama with MoE layers) exports as."""


def family_facts(name: str) -> Family:
    """The row of family `name` (ValueError naming the families when unknown)."""
    if name not in FAMILY_FACTS:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILY_FACTS)}")
    return FAMILY_FACTS[name]


def family_of_model_type(model_type: str) -> str | None:
    """The family whose config.json has this `model_type`, or None."""
    for name, facts in FAMILY_FACTS.items():
        if facts.hf_model_type == model_type:
            return name
    return None
