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
scales are not counted).

Offload (the rungs of the memory ladder): `--cpu-offload` (ZeRO-3, FSDP2's offload policy)
moves the rank's parameters, gradients and optimizer state to host memory; the offloaded
optimizer (`--optimizer-cpu-offload`, DeepSpeed's `offload_optimizer`) moves only the
optimizer's moments — S bytes an element; the fp32 parameters, gradients and master copies stay
on the device — to the host (`cpu` tier) or into swap files (`nvme` tier). Its step stages
chunks through host buffers (`OFFLOAD_BUFFER_COUNT` slots of `OFFLOAD_BUFFER_NUMEL` fp32
elements): m and v for the nvme tier, the parameter and gradient where they are not fp32 host
tensors (any accelerator run); those buffers are counted as host bytes too. With
`--param-nvme-path` (`param_nvme`, on top of `--cpu-offload`) the parameter shards move from the
host to the NVMe column, and the parameter tier's `PARAM_SWAP_BUFFER_COUNT` buffers, each the
rank's shards of its largest gather group (a decoder layer, or the root's embedding, final norm
and head), are host bytes. Tensor-parallel sharding: a plan style shards dim 0 (colwise, the
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
OPTIMIZER_OFFLOAD_TIERS = ("cpu", "nvme")
# The offloaded optimizer is AdamW (DeepSpeedCPUAdam's role); Megatron's "adam" is AdamW too.
OFFLOAD_OPTIMIZERS = ("adam", "adamw", "fused_adam")
OFFLOAD_BUFFER_NUMEL = 1 << 22
"""fp32 elements of one staging/swap buffer of the offloaded optimizer (DeepSpeed's buffer_size)."""
OFFLOAD_BUFFER_COUNT = 4
"""Buffer slots in flight: one stepped, the others read ahead / written behind."""
PARAM_SWAP_BUFFER_COUNT = 5
"""Host buffers of the parameter NVMe tier (DeepSpeed's offload_param buffer_count default): the
group being gathered and up to 4 read ahead."""


def param_group(name: str) -> str:
    """The FSDP group parameter `name` is gathered with: its decoder layer ("layers.3"), or the
    root's ("": embeddings, final norm, head)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else ""


def param_swap_buffer_bytes(
    largest_group_elements: int, buffer_count: int = PARAM_SWAP_BUFFER_COUNT
) -> int:
    """Host bytes of the parameter tier's fp32 buffers (each one group's shards)."""
    return 4 * buffer_count * largest_group_elements


def offload_buffer_bytes(
    tier: str,
    staged: bool,
    buffer_numel: int = OFFLOAD_BUFFER_NUMEL,
    buffer_count: int = OFFLOAD_BUFFER_COUNT,
) -> int:
    """Host bytes the offloaded optimizer's chunked step holds at most: per slot, m and v for
    the nvme tier and, when `staged` (parameters not fp32 host tensors), the parameter and its
    gradient."""
    tensors = (2 if tier == "nvme" else 0) + (2 if staged else 0)
    return tensors * buffer_count * buffer_numel * 4


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
    """Bytes of one rank's model states, and those moved off the device by offloading."""

    parameters: int
    """Parameters on the device."""
    gradients: int
    """Gradients on the device (fp32 copies included)."""
    optimizer: int
    """Optimizer state on the device (fp32 master copies included)."""
    host: int = 0
    """Bytes in host memory (offloaded states and the offloaded step's buffers)."""
    nvme: int = 0
    """Bytes in the NVMe tier's swap files."""


def state_bytes(
    parameters: int,
    optimizer_elements: int,
    *,
    mode: str,
    optimizer: str = "adamw",
    release_fp32_grad: bool = False,
    cpu_offload: bool = False,
    optimizer_offload: str | None = None,
    staged: bool = True,
    param_nvme: bool = False,
    param_buffer_bytes: int = 0,
) -> StateBytes:
    """Bytes of a rank holding `parameters` elements and the state of `optimizer_elements`.

    `optimizer_offload` is the offloaded optimizer's tier ("cpu", "nvme" or None); `staged`
    whether its step copies parameters and gradients through host buffers (an accelerator run).
    `param_nvme` (with `cpu_offload`) puts the parameters in the NVMe tier, whose host buffers
    take `param_buffer_bytes`.
    """
    if param_nvme and not cpu_offload:
        raise ValueError("parameters on NVMe (--param-nvme-path) need --cpu-offload (ZeRO-3)")
    per_state = OPTIMIZER_STATE_BYTES[optimizer]
    if mode == "master":
        params = 2 * parameters
        grads = (2 if release_fp32_grad else 6) * parameters
        optim = (per_state + 4) * optimizer_elements
    else:
        params, grads, optim = 4 * parameters, 4 * parameters, per_state * optimizer_elements
    host = nvme = 0
    if optimizer_offload is not None:
        if optimizer_offload not in OPTIMIZER_OFFLOAD_TIERS:
            raise ValueError(
                f"optimizer offload tier {optimizer_offload!r}: expected one of "
                f"{OPTIMIZER_OFFLOAD_TIERS}"
            )
        moments = per_state * optimizer_elements
        optim -= moments
        if optimizer_offload == "nvme":
            nvme = moments
        else:
            host = moments
        # Parameters already fp32 on the host (--cpu-offload) are stepped in place.
        host += offload_buffer_bytes(optimizer_offload, staged and not cpu_offload)
    if cpu_offload:
        # FSDP2's offload policy keeps the sharded parameters, their gradients and the optimizer
        # step on the host (ZeRO-3 with --cpu-offload).
        if param_nvme:
            return StateBytes(0, 0, 0, host + param_buffer_bytes + grads + optim, nvme + params)
        return StateBytes(0, 0, 0, host + params + grads + optim, nvme)
    return StateBytes(params, grads, optim, host, nvme)


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
    largest_group: int = 0
    """Parameters of its largest gather group (`param_group`): the parameter tier's buffer."""


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
    held: list[tuple[str, tuple[int, ...]]] = []
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
            held.append((param_group(name), tp_local_shape(name, shape, config, tp, plan)))
    parameters = optimizer = 0
    groups: dict[str, int] = {}
    for group, dims in held:
        row = math.prod(dims[1:])
        local_rows = chunk_rows(dims[0], fsdp_ranks, fsdp_index) if fsdp_ranks > 1 else dims[0]
        parameters += local_rows * row
        groups[group] = groups.get(group, 0) + local_rows * row
        state_rows = (
            chunk_rows(local_rows, zero1_ranks, zero1_index) if zero1_ranks > 1 else local_rows
        )
        optimizer += state_rows * row
    return RankElements(parameters, optimizer, max(groups.values(), default=0))
