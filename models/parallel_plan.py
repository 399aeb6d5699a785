"""Tensor-parallel plans: submodule name pattern → parallel style, as plain data.

The trainer turns a plan into DTensor `parallelize_module` calls; the same plan serves inference.
Patterns use `*` for one name component (the layer index). Style names are the keys of
`parallel.tp_registry.TP_STYLES`, which says how training and serving lay each one out:

- "vocab_parallel_embedding": embedding rows sharded over the vocabulary (RowwiseParallel on an
  nn.Embedding); output replicated, or sequence-sharded with sequence parallelism.
- "colwise" / "rowwise": Megatron column / row parallel linear layers.
- "colwise_packed_qkv": column parallel over a fused [q; k; v] weight — each rank takes its heads'
  slice of q, of k and of v (a plain colwise split would hand rank 0 only query rows).
- "colwise_packed_gate_up": the same for a fused [gate; up] weight.
- "sequence_parallel": a norm run on sequence-sharded activations (SequenceParallel).
- "colwise_loss_parallel": output head sharded over the vocabulary, logits left sharded for a
  loss-parallel cross entropy.
- "alibi_heads": an ALiBi attention module whose `head_offset` must be set to this rank's first
  head (rank · H/tp), so that each rank uses its own heads' slopes.
- "moe_experts": the stacked experts of an MoE layer (`models.moe.Experts`): every expert's
  [gate; up] column-parallel and its down projection row-parallel, partial outputs summed over
  the TP ranks. The router (`mlp.gate`) and shared experts are not in the plan: replicated.
- "moe_sequence_parallel": with sequence parallelism, the MoE layer itself: all-gathers its
  sequence-sharded input (every rank routes the whole micro-batch) and returns its sequence
  shard of the output (reduce-scattered from the experts' partial outputs, or, when expert
  parallelism keeps the experts whole, computed from the rank's own tokens only).
"""

from __future__ import annotations

import fnmatch

from models.config import ModelConfig


def tp_plan(config: ModelConfig, *, sequence_parallel: bool = True) -> dict[str, str]:
    """The TP plan of `config`'s model; norms appear only with sequence parallelism."""
    layer = "layers.*."
    plan: dict[str, str] = {"embed_tokens": "vocab_parallel_embedding"}
    if sequence_parallel:
        if config.embedding_layernorm:
            plan["embed_layernorm"] = "sequence_parallel"
        plan[layer + "input_layernorm"] = "sequence_parallel"
        plan[layer + "post_attention_layernorm"] = "sequence_parallel"
    if config.fused_qkv:
        plan[layer + "self_attn.qkv_proj"] = "colwise_packed_qkv"
    else:
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[layer + "self_attn." + name] = "colwise"
    plan[layer + "self_attn.o_proj"] = "rowwise"
    if config.position_embedding == "alibi":
        plan[layer + "self_attn"] = "alibi_heads"
    if config.moe is not None:
        if sequence_parallel:
            plan[layer + "mlp"] = "moe_sequence_parallel"
        plan[layer + "mlp.experts"] = "moe_experts"
    elif config.gated and config.fused_gate_up:
        plan[layer + "mlp.gate_up_proj"] = "colwise_packed_gate_up"
        plan[layer + "mlp.down_proj"] = "rowwise"
    else:
        if config.gated:
            plan[layer + "mlp.gate_proj"] = "colwise"
        plan[layer + "mlp.up_proj"] = "colwise"
        plan[layer + "mlp.down_proj"] = "rowwise"
    if sequence_parallel:
        plan["norm"] = "sequence_parallel"
    plan["lm_head"] = "colwise_loss_parallel"
    return plan


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError naming the size that tensor parallelism of `tp_size` cannot split."""
    checks = {
        "num_attention_heads": config.num_attention_heads,
        "num_kv_heads": config.kv_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
        "vocab_size": config.vocab_size,
    }
    for name, value in checks.items():
        if value % tp_size:
            raise ValueError(
                f"--tensor-model-parallel-size {tp_size} does not divide {name}={value}; "
                "choose a tensor-parallel size that divides it"
            )


def match_plan(plan: dict[str, str], module_names: list[str]) -> dict[str, str]:
    """Expand plan patterns against concrete module names (e.g. `model.named_modules()`)."""
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        for name in module_names:
            if fnmatch.fnmatchcase(name, pattern) and name.count(".") == pattern.count("."):
                resolved[name] = style
    return resolved


def format_plan(plan: dict[str, str]) -> str:
    """The plan as aligned text lines."""
    width = max(len(name) for name in plan)
    return "\n".join(f"{name:<{width}}  {style}" for name, style in plan.items())
