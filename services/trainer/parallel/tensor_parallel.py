"""Tensor and sequence parallelism: `models.parallel_plan` styles turned into DTensor plans.

Shapes: B batch, S sequence, E hidden, V vocab; S/t is a sequence shard over t TP ranks.

Plain styles map onto `torch.distributed.tensor.parallel` (embedding rows and the output head
sharded over the vocabulary, Megatron column/row linears, `SequenceParallel` norms). With
sequence parallelism the residual stream between blocks is [B, S/t, E] per rank: each attention
and MLP block all-gathers its input sequence and its row-parallel output is reduce-scattered back
(instead of all-reduced), so norms and dropout run on 1/t of the tokens.

Packed projections ([q; k; v], [gate; up]) and KV heads beyond the TP size are `SlicedColwise`:
the weight stays whole on every TP rank (a Replicate DTensor, so checkpoints keep the unsharded
layout and move between layouts) and each rank computes only its own rows; the gradient of the
whole weight is summed over the TP group in backward (Megatron's "copy to tensor-parallel region").
This keeps those weights' memory unsplit; compute and activations are split as usual.
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
from services.trainer.parallel.peft_tp import parallelize_with_adapters


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


class SlicedColwise(ParallelStyle):
    """Column-parallel over chosen rows of a weight kept whole (Replicate) on every TP rank."""

    def __init__(self, rows_of_rank: Callable[[int, int], torch.Tensor]) -> None:
        self.rows_of_rank = rows_of_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear), "SlicedColwise applies to nn.Linear"
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        rows = self.rows_of_rank(rank, size).to(module.weight.device)
        group = device_mesh.get_group()
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(replicated, param.requires_grad))

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = _SumGradOverGroup.apply(cast(DTensor, module.weight).to_local(), group)
            bias = module.bias
            if bias is not None:
                bias = _SumGradOverGroup.apply(cast(DTensor, bias).to_local(), group)
                bias = bias.index_select(0, rows)
            # Each rank's rows see the whole input: its gradient is a partial sum over ranks.
            x = _SumGradOverGroup.apply(x, group)
            return F.linear(x, weight.index_select(0, rows), bias)

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
    from services.trainer.parallel.expert_parallel import ExpertsTensorParallel

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
        # Attention takes (x, rope, padding mask, segment ids, cache); the MLP takes x.
        for suffix, extra in ((".self_attn", 4), (".mlp", 0)):
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),) + (None,) * extra,
                desired_input_layouts=(Replicate(),) + (None,) * extra,
                use_local_output=True,
            )
            for name in names:
                if name.endswith(suffix):
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
            _replicate_module(module, tp_mesh)
            resolved[name] = "replicate"
    return resolved


def _replicate_module(module: nn.Module, mesh: DeviceMesh) -> None:
    """Hold `module`'s own parameters as Replicate DTensors and run it on replicated DTensors.

    Optimizers and gradient clipping need every parameter of a TP model to be a DTensor (their
    foreach kernels refuse a mix); plain tensors in and out keep the module's neighbours as is.
    """

    def replicate_params(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
        for leaf, param in list(mod.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, mesh, [Replicate()])
            mod.register_parameter(leaf, nn.Parameter(replicated, param.requires_grad))

    def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False)
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
