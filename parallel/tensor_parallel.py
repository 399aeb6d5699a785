"""Tensor and sequence parallelism: `models.parallel_plan` styles turned into DTensor plans.

Shapes: B batch, S sequence, E hidden, V vocab; S/t is a sequence shard over t TP ranks.

Plain styles map onto `torch.distributed.tensor.parallel` (embedding rows and the output head
sharded over the vocabulary, Megatron column/row linears, `SequenceParallel` norms). With
sequence parallelism the residual stream between blocks is [B, S/t, E] per rank: each attention
and MLP block all-gathers its input sequence and its row-parallel output is reduce-scattered back
(instead of all-reduced), so norms and dropout run on 1/t of the tokens.

Packed projections ([q; k; v], [gate; up]) and KV heads beyond the TP size are `SlicedColwise`:
a rank computes with rows that are not one contiguous block (its q, k and v heads; its gate and
up halves), so the weight is stored as a plain Shard(0) DTensor in its global row order (1/tp of
the memory; checkpoints keep the global name, shape and order, so they move between layouts) and
each forward gathers the rank's rows with one all-to-all, whose backward returns the row
gradients to their owners. Megatron instead stores the rows permuted per rank and converts on
checkpointing; a 1-D `_StridedShard` would describe [gate; up] and MHA qkv but not GQA's unequal
parts, and DCP records one contiguous chunk per DTensor shard, which a strided shard is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.config import ModelConfig
from models.parallel_plan import match_plan, tp_plan
from parallel.peft_tp import parallelize_with_adapters
from parallel.tp_random import install_tp_rng_regions


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (each rank fed other rows)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherRows(torch.autograd.Function):
    """This rank's rows of a weight stored row-sharded (Shard(0)) over `group`, via all-to-all.

    Forward: every rank sends each other rank the rows it stores that the other one computes
    with; backward sends the row gradients back to their owners, which add them up (a row that
    several ranks use, a replicated KV head, gets the sum of their gradients).
    """

    @staticmethod
    def forward(ctx, shard_NE: torch.Tensor, plan: _RowExchange, group: dist.ProcessGroup):  # type: ignore[override]
        ctx.plan, ctx.group, ctx.shard_rows = plan, group, shard_NE.shape[0]
        send = shard_NE.index_select(0, plan.send_index).contiguous()
        received = send.new_empty((plan.recv_order.numel(), *shard_NE.shape[1:]))
        dist.all_to_all_single(received, send, plan.recv_counts, plan.send_counts, group=group)
        return received.index_select(0, plan.recv_order)

    @staticmethod
    def backward(ctx, grad_RE: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        grad_sent = grad_RE.new_empty((plan.recv_order.numel(), *grad_RE.shape[1:]))
        grad_sent.index_copy_(0, plan.recv_order, grad_RE.contiguous())
        grad_back = grad_RE.new_empty((plan.send_index.numel(), *grad_RE.shape[1:]))
        dist.all_to_all_single(
            grad_back, grad_sent, plan.send_counts, plan.recv_counts, group=ctx.group
        )
        grad_shard = grad_RE.new_zeros((ctx.shard_rows, *grad_RE.shape[1:]))
        return grad_shard.index_add_(0, plan.send_index, grad_back), None, None


class _RowExchange:
    """Who sends which stored rows to whom, for `_GatherRows` (fixed per weight shape and rank)."""

    def __init__(
        self, rows_of_rank: Callable[[int, int], torch.Tensor], num_rows: int, rank: int, tp: int
    ) -> None:
        # DTensor's Shard(0) split (torch.chunk): rank s stores rows [bounds[s], bounds[s+1]).
        per = -(-num_rows // tp)
        bounds = [min(s * per, num_rows) for s in range(tp + 1)]
        self.stored_rows = bounds[rank + 1] - bounds[rank]
        wanted = [rows_of_rank(r, tp) for r in range(tp)]
        send_index, self.send_counts = [], []
        for rows in wanted:
            held = rows[(rows >= bounds[rank]) & (rows < bounds[rank + 1])]
            send_index.append(held - bounds[rank])
            self.send_counts.append(held.numel())
        self.send_index = torch.cat(send_index)
        # Received blocks arrive by source rank; recv_order puts them back in this rank's order.
        rows = wanted[rank]
        owner = torch.bucketize(rows, torch.tensor(bounds[1:]), right=True)
        arrival = torch.argsort(owner, stable=True)
        self.recv_counts = [int((owner == s).sum()) for s in range(tp)]
        self.recv_order = torch.argsort(arrival)

    def to(self, device: torch.device) -> _RowExchange:
        """Index tensors on `device` (where the weight lives)."""
        self.send_index = self.send_index.to(device)
        self.recv_order = self.recv_order.to(device)
        return self


class SlicedColwise(ParallelStyle):
    """Column-parallel over chosen rows (`rows_of_rank`) of a weight stored row-sharded.

    The weight and bias are Shard(0) DTensors in their global row order (1/tp of the memory
    per rank; a checkpoint holds the unsharded layout under the same name and shape, so it moves
    between layouts). Each forward gathers the rows this rank computes with an all-to-all
    (`_GatherRows`): about 1/tp of the weight crosses the group per rank, and the same for its
    gradient in backward.
    """

    def __init__(self, rows_of_rank: Callable[[int, int], torch.Tensor]) -> None:
        self.rows_of_rank = rows_of_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear), "SlicedColwise applies to nn.Linear"
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        plan = _RowExchange(self.rows_of_rank, module.out_features, rank, size)
        plan.to(module.weight.device)
        group = device_mesh.get_group()
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)])
            assert sharded.to_local().shape[0] == plan.stored_rows, "Shard(0) split mismatch"
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = cast(DTensor, module.weight).to_local()
            bias = module.bias
            if bias is not None:
                # One exchange for both: the bias travels as an extra column.
                local_bias = cast(DTensor, bias).to_local()
                packed = torch.cat([weight, local_bias.unsqueeze(1)], dim=1)
                packed = _GatherRows.apply(packed, plan, group)
                weight, bias = packed[:, :-1], packed[:, -1]
            else:
                weight = _GatherRows.apply(weight, plan, group)
            # Each rank's rows see the whole input: its gradient is a partial sum over ranks.
            x = _SumGradOverGroup.apply(x, group)
            return F.linear(x, weight, bias)

        module.forward = forward  # type: ignore[method-assign,assignment]
        return module


def _packed_rows(parts: list[tuple[int, int]], head_dim: int) -> Callable[[int, int], torch.Tensor]:
    """Rows of a row-packed weight for a rank: from each (heads, tp_heads_used) part, the rank's
    heads. A part with fewer heads than TP ranks gives rank r head r·heads // tp (replication)."""

    def rows(rank: int, tp: int) -> torch.Tensor:
        picked, offset = [], 0
        for heads, _ in parts:
            if heads >= tp:
                per = heads // tp
                first, count = rank * per, per
            else:
                first, count = rank * heads // tp, 1
            start = (offset + first) * head_dim
            picked.append(torch.arange(start, start + count * head_dim))
            offset += heads
        return torch.cat(picked)

    return rows


def _styles(config: ModelConfig, tp: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan style name -> ParallelStyle for this model and TP size."""
    from parallel.expert_parallel import (
        ExpertsTensorParallel,
        MoESequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    h, k, d = config.num_attention_heads, config.kv_heads, config.head_dim
    styles: dict[str, ParallelStyle] = {
        "vocab_parallel_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=seq),
        "colwise_packed_qkv": SlicedColwise(_packed_rows([(h, h), (k, k), (k, k)], d)),
        "colwise_packed_gate_up": SlicedColwise(
            _packed_rows([(config.ffn_hidden_size, 0), (config.ffn_hidden_size, 0)], 1)
        ),
        # Plain local outputs: a norm output may become the residual stream (embed_layernorm).
        "sequence_parallel": SequenceParallel(use_local_output=True),
        "colwise_loss_parallel": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
        "kv_replicated": SlicedColwise(_packed_rows([(k, k)], d)),
        "moe_experts": ExpertsTensorParallel(
            config.ffn_hidden_size, sequence_parallel=sequence_parallel
        ),
        "moe_sequence_parallel": MoESequenceParallel(),
    }
    return styles


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, config: ModelConfig, *, sequence_parallel: bool
) -> dict[str, str]:
    """Shard `model` (a CausalLM or one pipeline stage of it) over `tp_mesh` in place.

    Returns the resolved plan (module name -> style) for logging. Logits come out as a DTensor
    sharded over the vocabulary: compute the loss with `tp_cross_entropy_sum`.
    """
    tp = tp_mesh.size()
    if config.embedding_layernorm and not sequence_parallel:
        raise ValueError("embedding layernorm models need --sequence-parallel under TP")
    h, k = config.num_attention_heads, config.kv_heads
    # The model reads a packed shard's head counts from its width and the full q:kv ratio; with
    # replicated KV heads (tp > K) that arithmetic only holds for some shapes.
    if config.fused_qkv and k < tp and (h // tp + 2) * h // (h + 2 * k) != h // tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} > num_kv_heads={k} with a fused qkv projection "
            f"and {h} heads cannot be split; use a TP size <= {k} or an unfused qkv model"
        )
    plan = tp_plan(config, sequence_parallel=sequence_parallel)
    if config.kv_heads < tp and not config.fused_qkv:
        for name in ("k_proj", "v_proj"):
            plan["layers.*.self_attn." + name] = "kv_replicated"
    styles = _styles(config, tp, sequence_parallel)
    names = [name for name, _ in model.named_modules()]
    resolved = match_plan(plan, names)
    heads_per_rank = config.num_attention_heads // tp
    for name, style in resolved.items():
        if style == "alibi_heads":
            # Column-parallel q keeps heads [r·H/t, (r+1)·H/t) on rank r: their slopes.
            attn = model.get_submodule(name)
            attn.head_offset = tp_mesh.get_local_rank() * heads_per_rank  # type: ignore[assignment]
    module_plan: dict[str, ParallelStyle] = {
        n: styles[s] for n, s in resolved.items() if s != "alibi_heads"
    }
    if sequence_parallel:
        # Attention takes (x, rope, padding mask, segment ids, cache); the MLP takes x. A
        # block with its own style (an MoE layer) gathers its input itself.
        for suffix, extra in ((".self_attn", 4), (".mlp", 0)):
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),) + (None,) * extra,
                desired_input_layouts=(Replicate(),) + (None,) * extra,
                use_local_output=True,
            )
            for name in names:
                if name.endswith(suffix) and name not in module_plan:
                    module_plan[name] = gather
                    resolved[name] = "gather_sequence"
    # LoRA layers take adapter-aware styles; PEFT-frozen parameters stay frozen.
    parallelize_with_adapters(
        model, tp_mesh, module_plan, resolved, sequence_parallel=sequence_parallel
    )
    tie_weights = getattr(model, "tie_weights", None)
    if config.tie_word_embeddings and callable(tie_weights):
        # Each style swapped in its own parameter, untying the head; both are vocabulary-row
        # shards (Shard(0)) on the same mesh, so the head can share the embedding's DTensor.
        tie_weights()
    for name, module in model.named_modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            # Qwen3's per-head q/k norms see only this rank's heads: their input is a head shard
            # (dim 2 of [B, S, heads, D]), so the scale's gradient is summed over the ranks.
            # Replicated kv heads (tp > K) are whole on every rank instead.
            head_shard = name.endswith(".self_attn.q_norm") or (
                name.endswith(".self_attn.k_norm") and config.kv_heads >= tp
            )
            _replicate_module(module, tp_mesh, Shard(2) if head_shard else Replicate())
            resolved[name] = "replicate (head-sharded input)" if head_shard else "replicate"
    for name in install_tp_rng_regions(
        model, config, tp_mesh.get_local_rank(), sequence_parallel=sequence_parallel
    ):
        resolved[name] = f"{resolved[name]} + tp_rng" if name in resolved else "tp_rng"
    return resolved


def _replicate_module(
    module: nn.Module, mesh: DeviceMesh, input_placement: Shard | Replicate | None = None
) -> None:
    """Hold `module`'s own parameters as Replicate DTensors and run it on DTensor inputs placed
    as `input_placement` (default Replicate; a Shard makes the parameters' gradients sums over
    the ranks).

    Optimizers and gradient clipping need every parameter of a TP model to be a DTensor (their
    foreach kernels refuse a mix); plain tensors in and out keep the module's neighbours as is.
    """

    def replicate_params(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for leaf, param in list(mod.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, mesh, [Replicate()])
            mod.register_parameter(leaf, nn.Parameter(replicated, param.requires_grad))

    placement = input_placement or Replicate()

    def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, [placement], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, replicate_params, inputs, outputs)  # type: ignore[arg-type]


def tp_cross_entropy_sum(
    logits_BSV: torch.Tensor, labels_BS: torch.Tensor, loss_mask_BS: torch.Tensor
) -> torch.Tensor:
    """Summed masked token loss of vocabulary-sharded logits (loss parallel: no full logits).

    Call (and backpropagate) inside `loss_parallel()`; plain logits fall back to F.cross_entropy.
    """
    flat = logits_BSV.flatten(0, 1).float()
    labels = labels_BS.flatten()
    if isinstance(flat, DTensor):
        labels = DTensor.from_local(labels, flat.device_mesh, [Replicate()], run_check=False)
    per_token = F.cross_entropy(flat, labels, ignore_index=-100, reduction="none")
    if isinstance(per_token, DTensor):
        per_token = per_token.to_local()
    return (per_token * loss_mask_BS.flatten().to(per_token.dtype)).sum()


__all__ = ["SlicedColwise", "apply_tensor_parallel", "loss_parallel", "tp_cross_entropy_sum"]
