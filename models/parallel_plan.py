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
- A learned position table (`embed_positions`, the gpt family) is not in the plan: every rank
  holds it whole and adds it to the replicated embedding output (no sequence parallelism).
- "value_head": a reward model's scalar head, replicated (its input gathered under sequence
  parallelism).
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
from dataclasses import dataclass

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
    # A reward model's scalar value head has one output: replicated, not vocabulary-sharded.
    plan["lm_head"] = "value_head" if config.value_head else "colwise_loss_parallel"
    return plan


@dataclass(frozen=True)
class SplitFlags:
    """How one command spells its parallel sizes, so that a refusal names the flag it was given."""

    tp: str = "--tensor-model-parallel-size"
    """The tensor-parallel size flag."""
    pp: str = "--pipeline-model-parallel-size"
    """The pipeline-parallel size flag."""
    kv_replicated: bool = True
    """KV heads fewer than the TP size are replicated (training); False: TP must divide them
    (serving shards, Megatron's query groups)."""
    vocab_padded: bool = False
    """The vocabulary is padded to a multiple of the TP size (Megatron files): not checked."""


TRAIN_FLAGS = SplitFlags()
SERVE_FLAGS = SplitFlags("--tensor-parallel-size", "--pipeline-parallel-size", kv_replicated=False)
CONVERT_FLAGS = SplitFlags(
    "--target-tensor-parallel-size",
    "--target-pipeline-parallel-size",
    kv_replicated=False,
    vocab_padded=True,
)


def divisors(n: int) -> str:
    """The divisors of `n` as text ("1, 2, 3, 6"; the first eight), for the fix a message
    proposes."""
    found = [d for d in range(1, min(n, 4096) + 1) if n % d == 0]
    return ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")


def check_split(
    *,
    tp: int,
    pp: int = 1,
    virtual: int = 1,
    num_layers: int | None,
    num_heads: int,
    num_kv_heads: int,
    ffn: int,
    vocab: int,
    flags: SplitFlags = TRAIN_FLAGS,
) -> None:
    """Raise ValueError, one line naming the command's flag, when TP/PP cannot split the sizes.

    The one check of a model against a parallel layout: the trainer (parent and workers),
    `meshline serve` and `meshline convert` call it before any weight is read. `num_layers`
    None: an uneven pipeline split the caller checked itself.
    """
    sizes = [("num_attention_heads", num_heads), ("ffn_hidden_size", ffn)]
    if not flags.vocab_padded:
        sizes.append(("vocab_size", vocab))
    for what, value in sizes:
        if value % tp:
            raise ValueError(
                f"{what} {value} is not divisible by {flags.tp} {tp}; choose a tensor-parallel "
                f"size that divides {value} ({divisors(value)})"
            )
    if flags.kv_replicated and num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"num_kv_heads {num_kv_heads} and {flags.tp} {tp}: one must divide the other (KV "
            "heads are split up to their number and replicated beyond); choose a tensor-parallel "
            f"size among {divisors(num_kv_heads)} or a multiple of {num_kv_heads}"
        )
    if not flags.kv_replicated and num_kv_heads % tp:
        raise ValueError(
            f"num_kv_heads {num_kv_heads} is not divisible by {flags.tp} {tp}; choose a "
            f"tensor-parallel size that divides {num_kv_heads} ({divisors(num_kv_heads)})"
        )
    stages = pp * virtual
    if num_layers is not None and num_layers % stages:
        chunks = f" × {virtual} virtual chunks" if virtual > 1 else ""
        raise ValueError(
            f"num_layers {num_layers} is not divisible by {flags.pp} {pp}{chunks} = {stages} "
            "pipeline stages (every stage holds the same number of layers); choose a pipeline "
            f"size that divides {num_layers} ({divisors(num_layers)})"
        )


def check_model_split(
    config: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    virtual: int = 1,
    flags: SplitFlags = TRAIN_FLAGS,
    even_layers: bool = True,
    sequence_parallel: bool = False,
) -> None:
    """`check_split` on `config`'s sizes, plus what the model's own layers rule out."""
    check_split(
        tp=tp,
        pp=pp,
        virtual=virtual,
        num_layers=config.num_layers if even_layers else None,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.kv_heads,
        ffn=config.ffn_hidden_size,
        vocab=config.vocab_size,
        flags=flags,
    )
    if sequence_parallel and tp > 1 and config.position_embedding == "learned":
        raise ValueError(
            "--sequence-parallel with learned absolute positions (--position-embedding-type "
            "learned_absolute, the gpt family) is not supported: drop --sequence-parallel"
        )


def check_tp_size(config: ModelConfig, tp_size: int, flags: SplitFlags = SERVE_FLAGS) -> None:
    """Raise ValueError naming the size that tensor parallelism of `tp_size` cannot split."""
    check_model_split(config, tp=tp_size, flags=flags, even_layers=False)


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
