"""Per-rank model-state memory: the elements a rank holds, and the bytes they take.

One counting serves `meshline estimate` and `meshline train --dry-run`: the dry run reads the
elements from the model the trainer's parallelize code builds (on the meta device, over a fake
process group), the estimate derives them here from the parameter shapes and the TP plan, and
both turn elements into bytes with `state_bytes`. A test holds the two equal for every
registered model on a grid of layouts.

Elements of a rank:
- `parameters`: elements of the parameters it stores (TP shards; under ZeRO-2/3 — FSDP2 — its
  dim-0 chunk, which both stages keep between steps: ZeRO-2 differs only in not resharding
  between forward and backward);
- `optimizer`: elements whose optimizer state it keeps (all its parameters; its ZeRO-1 chunk).

Bytes per element follow the precision mode the trainer picks (`precision_mode`, the rule of
training/precision.py) — the modes keep different copies:

| mode     | when                         | params | grads                      | optimizer state        |
| -------- | ---------------------------- | ------ | -------------------------- | ---------------------- |
| fp32     | no --bf16/--fp16             | 4      | 4                          | S                      |
| master   | 16-bit, ZeRO 0 (or 2/3 alone)| 2      | 2 + 4 fp32 copy (0 with --release-fp32-grad) | S + 4 fp32 master |
| autocast | 16-bit, ZeRO-1               | 4      | 4                          | S (chunk)              |
| fsdp     | 16-bit, ZeRO-2/3, >1 shard   | 4      | 4 (chunk)                  | S (chunk)              |

S is the optimizer's state per element: 8 for Adam/AdamW (two fp32 moments; the per-tensor step
counter is not counted), 4 for SGD with momentum, 1 for Cadam's int8 momentum (its per-row
scales are not counted). Tensor-parallel sharding: a plan style shards dim 0 (colwise, the
vocabulary-parallel embedding and head, the packed qkv with KV heads split up to their number
and replicated beyond) or dim 1 (rowwise); the stacked experts keep dim 0 = experts and split the down projection's
FFN dim, while their packed gate_up stays whole on every TP rank; biases of rowwise layers and
norms are replicated.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from models.config import ModelConfig
from models.parallel_plan import tp_plan
from models.pipeline import StageRange

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "fused_adam": 8, "sgd": 4, "cadam": 1}


def precision_mode(precision: str, zero_stage: int, sharding_ranks: int) -> str:
    """The trainer's precision mode for a run (see the table in the module doc)."""
    if precision == "fp32":
        return "fp32"
    if zero_stage >= 2 and sharding_ranks > 1:
        return "fsdp"
    if zero_stage == 1:
        return "autocast"
    return "master"


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one rank's model states, and those moved to host memory by offloading."""

    parameters: int
    gradients: int
    optimizer: int
    host: int = 0


def state_bytes(
    parameters: int,
    optimizer_elements: int,
    *,
    mode: str,
    optimizer: str = "adamw",
    release_fp32_grad: bool = False,
    cpu_offload: bool = False,
) -> StateBytes:
    """Bytes of a rank holding `parameters` elements and the state of `optimizer_elements`."""
    per_state = OPTIMIZER_STATE_BYTES[optimizer]
    if mode == "master":
        params = 2 * parameters
        grads = (2 if release_fp32_grad else 6) * parameters
        optim = (per_state + 4) * optimizer_elements
    else:
        params, grads, optim = 4 * parameters, 4 * parameters, per_state * optimizer_elements
    if cpu_offload:
        # FSDP2's offload policy keeps the sharded parameters, their gradients and the optimizer
        # step on the host (ZeRO-3 with --cpu-offload).
        return StateBytes(0, 0, 0, params + grads + optim)
    return StateBytes(params, grads, optim)


def chunk_rows(rows: int, ranks: int, index: int) -> int:
    """Rows of dim 0 that chunk `index` of `ranks` gets (`torch.chunk`'s split, which FSDP2 and
    ZeRO-1 use: ceil(rows / ranks) each, trailing chunks short or empty)."""
    per_rank = math.ceil(rows / ranks)
    start = min(index * per_rank, rows)
    return min(start + per_rank, rows) - start


def _style(module_name: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


def tp_local_shape(
    name: str, shape: torch.Size, config: ModelConfig, tp: int, plan: dict[str, str]
) -> tuple[int, ...]:
    """The shape of parameter `name` on one tensor-parallel rank of `tp`."""
    module, _, leaf = name.rpartition(".")
    style = _style(module, plan) or _style(name, plan)
    dims = list(shape)
    if tp == 1 or style is None or style in ("sequence_parallel", "alibi_heads"):
        return tuple(dims)
    if style == "moe_experts":
        # [X, E, F] down projection split over F; the packed [X, 2F, E] gate_up stays whole
        # (each rank computes its slice of it: parallel/expert_parallel.py).
        if leaf == "down_proj":
            dims[2] //= tp
    elif style == "rowwise":
        if leaf != "bias":
            dims[1] //= tp
    elif style == "colwise_packed_qkv":
        q_rows = config.num_attention_heads * config.head_dim // tp
        kv_rows = max(config.kv_heads // tp, 1) * config.head_dim
        dims[0] = q_rows + 2 * kv_rows
    else:  # colwise, colwise_packed_gate_up, vocab_parallel_embedding, colwise_loss_parallel
        dims[0] //= tp
    return tuple(dims)


@dataclass(frozen=True)
class RankElements:
    """Elements one rank holds (see the module doc)."""

    parameters: int
    optimizer: int


def rank_elements(
    named_shapes: list[tuple[str, torch.Size]],
    config: ModelConfig,
    stages: list[StageRange],
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    fsdp_ranks: int = 1,
    fsdp_index: int = 0,
    zero1_ranks: int = 1,
    zero1_index: int = 0,
) -> RankElements:
    """Elements of the rank that runs `stages`, from the whole model's parameter shapes.

    `fsdp_ranks` > 1 shards the parameters' (TP-local) dim 0 over that many ranks (ZeRO-2/3),
    `zero1_ranks` > 1 only the optimizer state (ZeRO-1); `*_index` is this rank's position.
    """
    plan = tp_plan(config, sequence_parallel=sequence_parallel)
    layer_ids = {i for stage in stages for i in stage.layer_ids}
    has_embedding = any(stage.has_embedding for stage in stages)
    has_head = any(stage.has_head for stage in stages)
    held: list[tuple[int, ...]] = []
    for name, shape in named_shapes:
        if name.startswith("layers."):
            keep = int(name.split(".")[1]) in layer_ids
        elif name.startswith(("embed_tokens.", "embed_positions.", "embed_layernorm.")):
            # A tied head on a last stage without the embedding keeps its own copy of it.
            tied_copy = name.startswith("embed_tokens.") and config.tie_word_embeddings
            keep = has_embedding or (tied_copy and has_head)
        else:  # final norm, lm_head
            keep = has_head
        if keep:
            held.append(tp_local_shape(name, shape, config, tp, plan))
    parameters = optimizer = 0
    for dims in held:
        row = math.prod(dims[1:])
        local_rows = chunk_rows(dims[0], fsdp_ranks, fsdp_index) if fsdp_ranks > 1 else dims[0]
        parameters += local_rows * row
        state_rows = (
            chunk_rows(local_rows, zero1_ranks, zero1_index) if zero1_ranks > 1 else local_rows
        )
        optimizer += state_rows * row
    return RankElements(parameters, optimizer)
