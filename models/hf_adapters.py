"""State-dict and config adapters between Meshline's CausalLM and HF transformers layouts.

Name map (layer i; Meshline ↔ HF):

| Meshline | Llama / InternLM / Aquila | Baichuan | Bloom |
|---|---|---|---|
| embed_tokens | model.embed_tokens | model.embed_tokens | transformer.word_embeddings |
| embed_layernorm | – | – | transformer.word_embeddings_layernorm |
| layers.i.input_layernorm | model.layers.i.input_layernorm | same | transformer.h.i.input_layernorm |
| layers.i.self_attn.{q,k,v}_proj or qkv_proj | model.layers.i.self_attn.{q,k,v}_proj | …self_attn.W_pack ([q;k;v]) | transformer.h.i.self_attention.query_key_value (per head [q,k,v]) |
| layers.i.self_attn.o_proj | model.layers.i.self_attn.o_proj | same | transformer.h.i.self_attention.dense |
| layers.i.post_attention_layernorm | model.layers.i.post_attention_layernorm | same | transformer.h.i.post_attention_layernorm |
| layers.i.mlp.{gate,up}_proj or gate_up_proj ([gate; up]) | model.layers.i.mlp.{gate,up}_proj | same | up: transformer.h.i.mlp.dense_h_to_4h |
| layers.i.mlp.down_proj | model.layers.i.mlp.down_proj | same | transformer.h.i.mlp.dense_4h_to_h |
| norm | model.norm | model.norm | transformer.ln_f |
| lm_head | lm_head (absent when tied) | lm_head | lm_head (absent: tied) |

Qwen2/Qwen3/Mistral use the Llama names (Qwen3 adds `self_attn.{q,k}_norm`). MoE layers (Mixtral,
Qwen2-MoE, Qwen3-MoE) keep transformers 5's in-memory names (`mlp.gate`, `mlp.experts.gate_up_proj`
[X, 2F, E], `mlp.experts.down_proj` [X, E, F]; Qwen2-MoE's `mlp.shared_expert.*` and
`mlp.shared_expert_gate`); with `per_expert=True` `to_hf` writes the per-expert layout that
`save_pretrained` puts on disk (Mixtral `block_sparse_moe.experts.j.w1/w3/w2`, Qwen
`mlp.experts.j.gate_proj/up_proj/down_proj`), which every transformers version loads; `from_hf`
reads both.

Adapters work key by key (an MoE layer's experts together), so a pipeline stage's partial state
dict converts too. Tensors are only re-sliced, stacked and concatenated, never recomputed, so both
directions round-trip bit-exactly. Config mapping lives in models/hf_config.py (re-exported here).
"""

from __future__ import annotations

import re

import torch

from models.config import ModelConfig
from models.families import MOE_EXPORT_FAMILY, MoEFacts, family_facts
from models.hf_config import HF_ARCH, config_from_hf, hf_config
from models.hf_gpt2 import gpt2_from_hf, gpt2_to_hf

HF_SCORE = "score.weight"
"""transformers' name for a sequence-classification head (a reward model's value head)."""

__all__ = ["HF_ARCH", "config_from_hf", "from_hf", "hf_config", "to_hf"]

StateDict = dict[str, torch.Tensor]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # on-disk names read
_BLOOM_NAMES = {
    "self_attn.o_proj": "self_attention.dense",
    "mlp.up_proj": "mlp.dense_h_to_4h",
    "mlp.down_proj": "mlp.dense_4h_to_h",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}
_BLOOM_TOP = {
    "embed_tokens": "transformer.word_embeddings",
    "embed_layernorm": "transformer.word_embeddings_layernorm",
    "norm": "transformer.ln_f",
    "lm_head": "lm_head",
}


def _unfuse(state: StateDict, config: ModelConfig) -> StateDict:
    """Meshline names with fused projections split into q/k/v and gate/up."""
    q, kv = config.num_attention_heads * config.head_dim, config.kv_heads * config.head_dim
    f = config.ffn_hidden_size
    out: StateDict = {}
    for name, tensor in state.items():
        if ".self_attn.qkv_proj." in name:
            for part, chunk in zip("qkv", tensor.split([q, kv, kv], dim=0), strict=True):
                out[name.replace("qkv_proj", f"{part}_proj")] = chunk
        elif ".mlp.gate_up_proj." in name:
            gate, up = tensor.split([f, f], dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = tensor
    return out


def _fuse(state: StateDict, config: ModelConfig) -> StateDict:
    """Inverse of `_unfuse` for the fusions `config` asks for."""
    out: StateDict = {}
    for name, tensor in state.items():
        if config.fused_qkv and ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", f"{p}_proj")] for p in "qkv"]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts, dim=0)
        elif config.fused_qkv and (".self_attn.k_proj." in name or ".self_attn.v_proj." in name):
            continue
        elif config.gated and config.fused_gate_up and ".mlp.gate_proj." in name:
            up = state[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([tensor, up], dim=0)
        elif config.gated and config.fused_gate_up and ".mlp.up_proj." in name:
            continue
        else:
            out[name] = tensor
    return out


def _bloom_qkv_to_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """[q; k; v] blocks → Bloom's per-head interleave [h0: q,k,v | h1: q,k,v | ...]."""
    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return stacked.reshape(-1, *q.shape[1:])


def _moe_to_hf(prefix: str, rest: str, tensor: torch.Tensor, per_expert: bool, facts: MoEFacts):
    """(HF name, tensor) pairs of one MoE-layer tensor (`rest` after "layers.i.")."""
    if rest.startswith("mlp.shared_experts."):
        leaf = rest.removeprefix("mlp.shared_experts.")
        if leaf.startswith("gate_up_proj."):
            gate, up = tensor.chunk(2, dim=0)
            end = leaf.removeprefix("gate_up_proj.")
            return [
                (f"{prefix}.mlp.shared_expert.gate_proj.{end}", gate),
                (f"{prefix}.mlp.shared_expert.up_proj.{end}", up),
            ]
        return [(f"{prefix}.mlp.shared_expert.{leaf}", tensor)]
    if not per_expert:
        return [(f"{prefix}.{rest}", tensor)]
    block = facts.block
    if rest == "mlp.gate.weight":
        return [(f"{prefix}.{block}.gate.weight", tensor)]
    names = facts.expert_names
    out = []
    for j, expert in enumerate(tensor.unbind(0)):
        base = f"{prefix}.{block}.experts.{j}."
        if rest == "mlp.experts.gate_up_proj":
            gate, up = expert.chunk(2, dim=0)
            out.append((base + names.get("gate_proj", "gate_proj") + ".weight", gate.contiguous()))
            out.append((base + names.get("up_proj", "up_proj") + ".weight", up.contiguous()))
        elif rest == "mlp.experts.down_proj":
            out.append(
                (base + names.get("down_proj", "down_proj") + ".weight", expert.contiguous())
            )
        else:
            return [(f"{prefix}.{rest}", tensor)]
    return out


def _moe_from_hf(hf_state: StateDict) -> StateDict:
    """HF MoE names (disk per-expert or in-memory) → Meshline's stacked names; others pass."""
    out: StateDict = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    shared: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in hf_state.items():
        match = _EXPERT.match(name)
        if match:
            layer, j, w = match.groups()
            experts.setdefault(layer, {}).setdefault(int(j), {})[_MIXTRAL_W.get(w, w)] = tensor
        elif ".block_sparse_moe.gate." in name:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
        elif ".mlp.shared_expert." in name:
            head, leaf = name.split(".mlp.shared_expert.")
            shared.setdefault(head, {})[leaf] = tensor
        else:
            out[name] = tensor
    for layer, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"from_hf: {layer} has experts {sorted(by_index)}, not 0..X-1")
        ordered = [by_index[j] for j in range(len(by_index))]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([e["gate_proj"], e["up_proj"]], dim=0) for e in ordered]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([e["down_proj"] for e in ordered])
    for head, leaves in shared.items():
        for leaf, tensor in leaves.items():
            if leaf.startswith("gate_proj."):
                up = leaves[leaf.replace("gate_proj.", "up_proj.", 1)]
                end = leaf.removeprefix("gate_proj.")
                out[f"{head}.mlp.shared_experts.gate_up_proj.{end}"] = torch.cat([tensor, up])
            elif not leaf.startswith("up_proj."):
                out[f"{head}.mlp.shared_experts.{leaf}"] = tensor
    return out


def to_hf(state: StateDict, config: ModelConfig, *, per_expert: bool = False) -> StateDict:
    """Meshline state dict → the HF layout of `config.family` (tied head omitted, as HF saves).

    `per_expert` writes MoE experts one tensor each, as `save_pretrained` stores them on disk.
    A value head (`config.value_head`) is written as `score.weight`, the name transformers'
    `...ForSequenceClassification` gives it.
    """
    if config.value_head:
        body = {name: t for name, t in state.items() if name != "lm_head.weight"}
        out = to_hf(body, config.replace(value_head=False), per_expert=per_expert)
        if "lm_head.weight" in state:
            out[HF_SCORE] = state["lm_head.weight"]
        return out
    canon = _unfuse(state, config)
    facts = family_facts(config.family)
    if facts.layout == "gpt2":
        return gpt2_to_hf(canon, config)
    moe_facts = facts.moe
    if config.moe is not None and moe_facts is None:  # exported as HF Mixtral (hf_config)
        moe_facts = family_facts(MOE_EXPORT_FAMILY).moe
    out: StateDict = {}
    bloom = facts.layout == "bloom"
    for name, tensor in canon.items():
        if name.startswith("lm_head.") and config.tie_word_embeddings:
            continue
        match = _LAYER.match(name)
        if match is None:
            if bloom:
                module, _, leaf = name.rpartition(".")
                out[f"{_BLOOM_TOP[module]}.{leaf}"] = tensor
            else:
                out[name if name.startswith("lm_head.") else f"model.{name}"] = tensor
            continue
        layer, rest = match.groups()
        if ".k_proj." in rest or ".v_proj." in rest:
            continue
        if ".q_proj." in rest:
            parts = [canon[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            leaf = rest.rpartition(".")[2]
            if bloom:
                fused = _bloom_qkv_to_hf(parts[0], parts[1], parts[2], config.num_attention_heads)
                out[f"transformer.h.{layer}.self_attention.query_key_value.{leaf}"] = fused
            elif facts.packed_qkv is not None:
                packed = f"model.layers.{layer}.self_attn.{facts.packed_qkv}.{leaf}"
                out[packed] = torch.cat(parts, dim=0)
            else:
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    out[f"model.layers.{layer}.self_attn.{proj}.{leaf}"] = part
            continue
        if bloom:
            module, _, leaf = rest.rpartition(".")
            out[f"transformer.h.{layer}.{_BLOOM_NAMES[module]}.{leaf}"] = tensor
        elif moe_facts is not None and rest.startswith("mlp."):
            prefix = f"model.layers.{layer}"
            out.update(_moe_to_hf(prefix, rest, tensor, per_expert, moe_facts))
        else:
            out[f"model.layers.{layer}.{rest}"] = tensor
    return out


def from_hf(hf_state: StateDict, config: ModelConfig) -> StateDict:
    """HF state dict of `config.family` → Meshline names and fusions (inverse of `to_hf`)."""
    if config.value_head:
        body = {name: t for name, t in hf_state.items() if name != HF_SCORE}
        out = from_hf(body, config.replace(value_head=False))
        if HF_SCORE in hf_state:
            out["lm_head.weight"] = hf_state[HF_SCORE]
        return out
    facts = family_facts(config.family)
    if facts.layout == "gpt2":
        return gpt2_from_hf(hf_state, config)
    q, kv = config.num_attention_heads * config.head_dim, config.kv_heads * config.head_dim
    canon: StateDict = {}
    bloom_top = {hf: ours for ours, hf in _BLOOM_TOP.items()}
    bloom_layer = {hf: ours for ours, hf in _BLOOM_NAMES.items()}
    if config.moe is not None:
        hf_state = _moe_from_hf(hf_state)
    for name, tensor in hf_state.items():
        if name.endswith(("rotary_emb.inv_freq", "attention.bias", "masked_bias")):
            continue  # derived buffers some checkpoints carry
        if facts.layout == "bloom":
            match = re.match(r"^transformer\.h\.(\d+)\.(.+)\.(weight|bias)$", name)
            if match is None:
                module, _, leaf = name.rpartition(".")
                if module not in bloom_top:
                    raise ValueError(f"from_hf: unexpected Bloom tensor {name!r}")
                canon[f"{bloom_top[module]}.{leaf}"] = tensor
                continue
            layer, module, leaf = match.groups()
            prefix = f"layers.{layer}."
            if module == "self_attention.query_key_value":
                heads = config.num_attention_heads
                per_head = tensor.reshape(heads, 3, -1, *tensor.shape[1:])
                for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    part = per_head[:, i].reshape(-1, *tensor.shape[1:])
                    canon[f"{prefix}self_attn.{proj}.{leaf}"] = part
            elif module in bloom_layer:
                canon[f"{prefix}{bloom_layer[module]}.{leaf}"] = tensor
            else:
                raise ValueError(f"from_hf: unexpected Bloom tensor {name!r}")
            continue
        ours = name.removeprefix("model.")
        packed = facts.packed_qkv
        if packed is not None and f".self_attn.{packed}." in ours:
            for proj, part in zip(("q", "k", "v"), tensor.split([q, kv, kv], dim=0), strict=True):
                canon[ours.replace(packed, f"{proj}_proj")] = part
        else:
            canon[ours] = tensor
    if config.tie_word_embeddings and "embed_tokens.weight" in canon:
        canon.setdefault("lm_head.weight", canon["embed_tokens.weight"])
    return _fuse(canon, config)
