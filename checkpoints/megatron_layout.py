"""Megatron legacy tensor layout: names, tensor-parallel splits and pipeline stage ranges.

Shapes: E hidden, H heads, K kv heads (query groups), D head dim, F ffn, V vocab, T TP size.

Per layer (Megatron name ← Meshline name, TP split):

| Megatron (inside `layers.<local>.`) | Meshline | split |
|---|---|---|
| input_norm.{weight,bias} | input_layernorm | replicated |
| self_attention.query_key_value.{weight,bias} | q/k/v (qkv_proj) | column, per query group |
| self_attention.dense.weight / .bias | self_attn.o_proj | row (dim 1) / replicated |
| post_attention_norm.{weight,bias} | post_attention_layernorm | replicated |
| mlp.dense_h_to_4h.{weight,bias} | [gate; up] (gate_up_proj) or up_proj | column, gate and up per rank |
| mlp.dense_4h_to_h.weight / .bias | mlp.down_proj | row (dim 1) / replicated |

| self_attention.{q,k}_layernorm.weight | self_attn.{q,k}_norm (Qwen3) | replicated |
| mlp.router.weight | mlp.gate (MoE router) | replicated |
| mlp.experts.local_experts.j.dense_h_to_4h.weight | expert j's [gate; up] | column, gate and up per rank |
| mlp.experts.local_experts.j.dense_4h_to_h.weight | expert j's down | row (dim 1) |
| mlp.shared_experts.dense_h_to_4h / dense_4h_to_h | mlp.shared_experts | as the dense MLP |
| mlp.shared_expert_gate.weight | mlp.shared_expert_gate | replicated |

The query-key-value bias exists with attention_bias or qkv_bias (Megatron --add-qkv-bias); the
dense bias only with attention_bias. MoE checkpoints hold every expert in every file (expert
parallelism is a training layout, not a checkpoint one here).

Query-key-value rows are grouped per query group g: [q heads of g (H/K·D rows), k_g (D), v_g
(D)], groups in order, so a TP rank holds K/T whole groups. SwiGLU's `dense_h_to_4h` holds, on
rank r, [gate rows of r; up rows of r]. Embedding and output layer rows are the vocabulary, padded
with zero rows to a multiple of `make_vocab_size_divisible_by`·T and split evenly. A learned
position table (`embedding.position_embeddings.weight`, GPT's learned_absolute) is whole on every
rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from checkpoints.units import POST, PRE, Tensors, Unit
from models.config import ModelConfig

Shards = dict[str, list[torch.Tensor]]
"""Megatron name (relative to its container) → one tensor per TP rank."""

_LAYER_NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attention_norm"}


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of divisible_by·tp."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


@dataclass(frozen=True)
class StageLayout:
    """Which layers each pipeline stage (and virtual chunk) of a Megatron checkpoint holds."""

    num_layers: int
    pp: int
    chunks: int = 1
    """Virtual pipeline chunks per stage (`model0`, `model1`, ...); 1 means plain `model`."""

    def __post_init__(self) -> None:
        if self.num_layers % (self.pp * self.chunks):
            raise ValueError(
                f"--target-pipeline-parallel-size {self.pp} with {self.chunks} virtual chunk(s) "
                f"does not divide the model's {self.num_layers} layers; pick sizes whose product "
                "divides the layer count"
            )

    @property
    def per_chunk(self) -> int:
        """Layers in one chunk."""
        return self.num_layers // (self.pp * self.chunks)

    def layers(self, stage: int, chunk: int) -> range:
        """Global layer indices of `chunk` on pipeline stage `stage` (Megatron's interleaving)."""
        start = chunk * self.pp * self.per_chunk + stage * self.per_chunk
        return range(start, start + self.per_chunk)

    def locate(self, layer: int) -> tuple[int, int, int]:
        """(stage, chunk, local index) of a global layer."""
        block, local = divmod(layer, self.per_chunk)
        chunk, stage = divmod(block, self.pp)
        return stage, chunk, local


def _split(tensor: torch.Tensor, tp: int, dim: int, what: str) -> list[torch.Tensor]:
    if tensor.shape[dim] % tp:
        raise ValueError(
            f"{what}: size {tensor.shape[dim]} along dim {dim} is not divisible by tensor-parallel "
            f"size {tp}; choose a TP size that divides it"
        )
    return [t.contiguous() for t in tensor.chunk(tp, dim=dim)]


def _qkv_parts(tensors: Tensors, prefix: str, leaf: str, config: ModelConfig) -> list[torch.Tensor]:
    fused = tensors.get(f"{prefix}qkv_proj.{leaf}")
    if fused is None:
        return [tensors[f"{prefix}{p}_proj.{leaf}"] for p in "qkv"]
    q, kv = config.num_attention_heads * config.head_dim, config.kv_heads * config.head_dim
    return list(fused.split([q, kv, kv], dim=0))


def _gate_up_parts(
    tensors: Tensors, prefix: str, leaf: str, config: ModelConfig
) -> list[torch.Tensor]:
    fused = tensors.get(f"{prefix}gate_up_proj.{leaf}")
    if fused is not None:
        return list(fused.chunk(2, dim=0))
    return [tensors[f"{prefix}gate_proj.{leaf}"], tensors[f"{prefix}up_proj.{leaf}"]]


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] blocks → Megatron's per-group [q_g, k_g, v_g] rows."""
    rest = q.shape[1:]
    per_group = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def _deinterleave_qkv(qkv: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    groups, d = config.kv_heads, config.head_dim
    q_per_group = config.num_attention_heads // groups * d
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, q_per_group + 2 * d, *rest)
    q, k, v = grouped.split([q_per_group, d, d], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def _qkv_leaves(config: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.attention_bias or config.qkv_bias else ("weight",)


def _moe_to_megatron(layer: int, tensors: Tensors, tp: int) -> Shards:
    prefix, what = f"layers.{layer}.mlp.", f"layer {layer} experts"
    out: Shards = {"mlp.router.weight": [tensors[prefix + "gate.weight"]] * tp}
    gate_up = tensors[prefix + "experts.gate_up_proj"]
    down = tensors[prefix + "experts.down_proj"]
    for j in range(gate_up.shape[0]):
        gate, up = gate_up[j].chunk(2, dim=0)
        ranks = zip(_split(gate, tp, 0, what), _split(up, tp, 0, what), strict=True)
        name = f"mlp.experts.local_experts.{j}."
        out[name + "dense_h_to_4h.weight"] = [torch.cat(pair, dim=0) for pair in ranks]
        out[name + "dense_4h_to_h.weight"] = _split(down[j], tp, 1, what)
    shared = prefix + "shared_experts."
    if shared + "gate_up_proj.weight" in tensors:
        gate, up = tensors[shared + "gate_up_proj.weight"].chunk(2, dim=0)
        ranks = zip(_split(gate, tp, 0, what), _split(up, tp, 0, what), strict=True)
        out["mlp.shared_experts.dense_h_to_4h.weight"] = [torch.cat(p, dim=0) for p in ranks]
        out["mlp.shared_experts.dense_4h_to_h.weight"] = _split(
            tensors[shared + "down_proj.weight"], tp, 1, what
        )
    if prefix + "shared_expert_gate.weight" in tensors:
        out["mlp.shared_expert_gate.weight"] = [tensors[prefix + "shared_expert_gate.weight"]] * tp
    return out


def _moe_from_megatron(layer: int, shards: Shards, config: ModelConfig) -> Tensors:
    prefix = f"layers.{layer}.mlp."
    out: Tensors = {prefix + "gate.weight": _replicated(shards["mlp.router.weight"], "router")}
    assert config.moe is not None  # the caller checked
    experts = config.moe.num_experts
    gate_up, down = [], []
    for j in range(experts):
        name = f"mlp.experts.local_experts.{j}."
        pairs = [r.chunk(2, dim=0) for r in shards[name + "dense_h_to_4h.weight"]]
        gate_up.append(torch.cat([g for g, _ in pairs] + [u for _, u in pairs], dim=0))
        down.append(torch.cat(shards[name + "dense_4h_to_h.weight"], dim=1))
    out[prefix + "experts.gate_up_proj"] = torch.stack(gate_up)
    out[prefix + "experts.down_proj"] = torch.stack(down)
    if "mlp.shared_experts.dense_h_to_4h.weight" in shards:
        pairs = [r.chunk(2, dim=0) for r in shards["mlp.shared_experts.dense_h_to_4h.weight"]]
        out[prefix + "shared_experts.gate_up_proj.weight"] = torch.cat(
            [g for g, _ in pairs] + [u for _, u in pairs], dim=0
        )
        out[prefix + "shared_experts.down_proj.weight"] = torch.cat(
            shards["mlp.shared_experts.dense_4h_to_h.weight"], dim=1
        )
    if "mlp.shared_expert_gate.weight" in shards:
        out[prefix + "shared_expert_gate.weight"] = _replicated(
            shards["mlp.shared_expert_gate.weight"], "shared_expert_gate"
        )
    return out


def layer_to_megatron(layer: int, tensors: Tensors, config: ModelConfig, tp: int) -> Shards:
    """One decoder layer's tensors as Megatron layer-relative names, split over `tp` ranks."""
    if config.kv_heads % tp:
        raise ValueError(
            f"--target-tensor-parallel-size {tp} does not divide the model's {config.kv_heads} "
            "key/value heads (query groups); Megatron keeps whole groups per rank"
        )
    prefix = f"layers.{layer}."
    out: Shards = {}
    for leaf in _qkv_leaves(config):
        q, k, v = _qkv_parts(tensors, prefix + "self_attn.", leaf, config)
        qkv = _interleave_qkv(q, k, v, config.kv_heads)
        out[f"self_attention.query_key_value.{leaf}"] = _split(qkv, tp, 0, f"layer {layer} qkv")
    out["self_attention.dense.weight"] = _split(
        tensors[prefix + "self_attn.o_proj.weight"], tp, 1, f"layer {layer} o_proj"
    )
    if config.attention_bias:
        out["self_attention.dense.bias"] = [tensors[prefix + "self_attn.o_proj.bias"]] * tp
    for norm in ("q_norm", "k_norm"):
        if f"{prefix}self_attn.{norm}.weight" in tensors:
            theirs = f"self_attention.{norm[0]}_layernorm.weight"
            out[theirs] = [tensors[f"{prefix}self_attn.{norm}.weight"]] * tp
    if config.moe is not None:
        out.update(_moe_to_megatron(layer, tensors, tp))
        _norms_to_megatron(prefix, tensors, tp, out)
        return out
    mlp_leaves = ("weight", "bias") if config.mlp_bias else ("weight",)
    for leaf in mlp_leaves:
        what = f"layer {layer} mlp"
        if config.gated:
            gate, up = _gate_up_parts(tensors, prefix + "mlp.", leaf, config)
            ranks = zip(_split(gate, tp, 0, what), _split(up, tp, 0, what), strict=True)
            out[f"mlp.dense_h_to_4h.{leaf}"] = [torch.cat(pair, dim=0) for pair in ranks]
        else:
            out[f"mlp.dense_h_to_4h.{leaf}"] = _split(
                tensors[f"{prefix}mlp.up_proj.{leaf}"], tp, 0, what
            )
    out["mlp.dense_4h_to_h.weight"] = _split(
        tensors[prefix + "mlp.down_proj.weight"], tp, 1, f"layer {layer} down_proj"
    )
    if config.mlp_bias:
        out["mlp.dense_4h_to_h.bias"] = [tensors[prefix + "mlp.down_proj.bias"]] * tp
    _norms_to_megatron(prefix, tensors, tp, out)
    return out


def _norms_to_megatron(prefix: str, tensors: Tensors, tp: int, out: Shards) -> None:
    for ours, theirs in _LAYER_NORMS.items():
        for leaf in ("weight", "bias"):
            name = f"{prefix}{ours}.{leaf}"
            if name in tensors:
                out[f"{theirs}.{leaf}"] = [tensors[name]] * tp


def _replicated(shards: list[torch.Tensor], what: str) -> torch.Tensor:
    first = shards[0]
    for rank, other in enumerate(shards[1:], start=1):
        if not torch.equal(first, other):
            raise ValueError(
                f"{what} should be identical on every TP rank but rank {rank} differs from rank 0; "
                "the checkpoint is corrupted or was not written by Megatron"
            )
    return first


def layer_from_megatron(layer: int, shards: Shards, config: ModelConfig) -> Tensors:
    """Inverse of `layer_to_megatron`: TP shards → the layer's Meshline tensors (config fusions)."""
    prefix = f"layers.{layer}."
    out: Tensors = {}
    for leaf in _qkv_leaves(config):
        qkv = torch.cat(shards[f"self_attention.query_key_value.{leaf}"], dim=0)
        q, k, v = _deinterleave_qkv(qkv, config)
        if config.fused_qkv:
            out[f"{prefix}self_attn.qkv_proj.{leaf}"] = torch.cat([q, k, v], dim=0)
        else:
            for part, tensor in zip("qkv", (q, k, v), strict=True):
                out[f"{prefix}self_attn.{part}_proj.{leaf}"] = tensor
    out[prefix + "self_attn.o_proj.weight"] = torch.cat(
        shards["self_attention.dense.weight"], dim=1
    )
    if config.attention_bias:
        out[prefix + "self_attn.o_proj.bias"] = _replicated(
            shards["self_attention.dense.bias"], f"layer {layer} self_attention.dense.bias"
        )
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            theirs = f"self_attention.{norm[0]}_layernorm.weight"
            out[f"{prefix}self_attn.{norm}.weight"] = _replicated(shards[theirs], theirs)
    if config.moe is not None:
        out.update(_moe_from_megatron(layer, shards, config))
        _norms_from_megatron(layer, prefix, shards, out)
        return out
    mlp_leaves = ("weight", "bias") if config.mlp_bias else ("weight",)
    for leaf in mlp_leaves:
        ranks = shards[f"mlp.dense_h_to_4h.{leaf}"]
        if config.gated:
            pairs = [r.chunk(2, dim=0) for r in ranks]
            gate = torch.cat([g for g, _ in pairs], dim=0)
            up = torch.cat([u for _, u in pairs], dim=0)
            if config.fused_gate_up:
                out[f"{prefix}mlp.gate_up_proj.{leaf}"] = torch.cat([gate, up], dim=0)
            else:
                out[f"{prefix}mlp.gate_proj.{leaf}"] = gate
                out[f"{prefix}mlp.up_proj.{leaf}"] = up
        else:
            out[f"{prefix}mlp.up_proj.{leaf}"] = torch.cat(ranks, dim=0)
    out[prefix + "mlp.down_proj.weight"] = torch.cat(shards["mlp.dense_4h_to_h.weight"], dim=1)
    if config.mlp_bias:
        out[prefix + "mlp.down_proj.bias"] = _replicated(
            shards["mlp.dense_4h_to_h.bias"], f"layer {layer} mlp.dense_4h_to_h.bias"
        )
    _norms_from_megatron(layer, prefix, shards, out)
    return out


def _norms_from_megatron(layer: int, prefix: str, shards: Shards, out: Tensors) -> None:
    for ours, theirs in _LAYER_NORMS.items():
        for leaf in ("weight", "bias"):
            if f"{theirs}.{leaf}" in shards:
                out[f"{prefix}{ours}.{leaf}"] = _replicated(
                    shards[f"{theirs}.{leaf}"], f"layer {layer} {theirs}.{leaf}"
                )


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    extra = padded - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows exceeds the padded size {padded}")
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])]) if extra else weight


RM_HEAD = "rm_head.weight"
"""A reward model's scalar value head in a Megatron checkpoint (MindSpeed-LLM's `rm_head`): one
[1, E] row on the last stage, the same on every TP rank, in place of the output layer."""


def edge_to_megatron(
    unit: Unit, tensors: Tensors, tp: int, padded_vocab: int, value_head: bool = False
) -> Shards:
    """The "pre" or "post" unit as Megatron names relative to `language_model.` (split over tp);
    a value head (`value_head`) is written whole to every rank as `rm_head.weight`."""
    out: Shards = {}
    if unit == PRE:
        embed = _pad_vocab(tensors["embed_tokens.weight"], padded_vocab)
        out["embedding.word_embeddings.weight"] = _split(embed, tp, 0, "embedding")
        if "embed_positions.weight" in tensors:  # learned_absolute: every rank holds the table
            out["embedding.position_embeddings.weight"] = [tensors["embed_positions.weight"]] * tp
        for leaf in ("weight", "bias"):
            if f"embed_layernorm.{leaf}" in tensors:
                out[f"embedding.word_embeddings.norm.{leaf}"] = [
                    tensors[f"embed_layernorm.{leaf}"]
                ] * tp
        return out
    assert unit == POST
    for leaf in ("weight", "bias"):
        if f"norm.{leaf}" in tensors:
            out[f"encoder.final_norm.{leaf}"] = [tensors[f"norm.{leaf}"]] * tp
    if "lm_head.weight" in tensors and value_head:
        out[RM_HEAD] = [tensors["lm_head.weight"]] * tp
    elif "lm_head.weight" in tensors:
        head = _pad_vocab(tensors["lm_head.weight"], padded_vocab)
        out["output_layer.weight"] = _split(head, tp, 0, "output layer")
    return out


def edge_from_megatron(unit: Unit, shards: Shards, config: ModelConfig) -> Tensors:
    """Inverse of `edge_to_megatron`; vocabulary padding is dropped."""
    out: Tensors = {}
    vocab = config.vocab_size
    if unit == PRE:
        out["embed_tokens.weight"] = torch.cat(shards["embedding.word_embeddings.weight"])[:vocab]
        positions = "embedding.position_embeddings.weight"
        if config.position_embedding == "learned":
            if positions not in shards:
                raise ValueError(
                    f"{positions} is missing: a learned_absolute model needs its position table"
                )
            out["embed_positions.weight"] = _replicated(shards[positions], positions)
        for leaf in ("weight", "bias"):
            name = f"embedding.word_embeddings.norm.{leaf}"
            if name in shards:
                out[f"embed_layernorm.{leaf}"] = _replicated(shards[name], name)
        return out
    for leaf in ("weight", "bias"):
        name = f"encoder.final_norm.{leaf}"
        if name in shards:
            out[f"norm.{leaf}"] = _replicated(shards[name], name)
    if config.value_head:
        out["lm_head.weight"] = _replicated(shards[RM_HEAD], RM_HEAD)
    elif not config.tie_word_embeddings:
        out["lm_head.weight"] = torch.cat(shards["output_layer.weight"])[:vocab]
    return out
