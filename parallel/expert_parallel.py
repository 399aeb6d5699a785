"""Expert parallelism: each rank of the `ep` group holds X/ep experts of every MoE layer, and
routed token copies travel to their expert's rank and back with all-to-all. Also the
tensor-parallel style of the experts (`ExpertsTensorParallel`), of a whole MoE layer under
sequence parallelism (`MoESequenceParallel`), and the auxiliary-loss statistics of MoE layers
under context parallelism (`apply_moe_context_parallel`).

Shapes: B batch, S sequence (s = S/t, a sequence shard), N tokens B·S (n = B·s), K top-k,
T routed token copies, E hidden, X experts (global), L experts per rank, P ep size, F expert ffn
width, t tensor-parallel size.

The model file (`models/moe.py`) routes and combines; this module only swaps in the dispatcher
and slices the expert weights. Per step and layer a rank exchanges its per-expert copy counts
(one small all-to-all), then the copies themselves (all-to-all with uneven splits, autograd-aware
through `torch.distributed.nn.functional`), runs its experts on everything it received, and sends
the outputs back along the reverse split.

As in Megatron, the ep ranks are carved out of the data-parallel ranks: with data-parallel size
dp, ranks that differ only in their `ep` coordinate read different batches and hold different
experts; the dp/ep ranks with the same `ep` coordinate (the `edp` axis) hold the same experts.
Expert weights are `Shard(0)` DTensors on the `ep` mesh, so checkpoints (DCP) keep the global
`[X, ...]` tensors under their global names and load into any other ep size, and gradient norms
reduce over the shards. Gradients: an expert's gradient already sums the contributions of every
ep rank's tokens (the all-to-all's backward); `ExpertParallelGradSync` then sums it over `edp`
and averages replicated parameters over all dp ranks. With tensor parallelism as well, the ep
groups are the ranks with the same `tp` coordinate and each TP rank runs its ep block whole
(Megatron's expert-tensor-parallel size 1); without EP, `ExpertsTensorParallel` splits every
expert over the TP ranks instead. Under pipeline parallelism each stage chunk gets its own
dispatchers (the ep group lies within the stage) and the sync reduces chunk by chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.moe import Experts, MoE, expert_outputs, moe_layers
from parallel.collectives import (
    copy_to_group,
    gather_sequence_for_both,
    reduce_from_group,
    reduce_scatter_sequence,
    sum_over_group,
)

EXPERT_LEAVES = ("gate_up_proj", "down_proj")


class AllToAllDispatcher:
    """Sends each expert's token copies to the rank that holds the expert (contiguous blocks)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(
                f"--expert-model-parallel-size {self.size} must divide --num-experts {num_experts}"
            )
        self.local = num_experts // self.size

    def run(self, experts: Experts, x_TE: torch.Tensor, counts_X: torch.Tensor) -> torch.Tensor:
        """Outputs for the rows of `x_TE` (grouped by global expert id, `counts_X` per expert)."""
        send_PL = counts_X.to(torch.int64).view(self.size, self.local)
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL, send_PL, group=self.group)
        send_splits = send_PL.sum(dim=1).tolist()
        recv_splits = recv_PL.sum(dim=1).tolist()
        recv_TE = dist_fn.all_to_all_single(
            x_TE.new_empty(sum(recv_splits), x_TE.shape[1]),
            x_TE,
            recv_splits,
            send_splits,
            group=self.group,
        )
        # Received rows are source-major ([src 0: expert 0.., src 1: ...]); experts want
        # expert-major, so permute, run, and put the outputs back in arrival order.
        perm = _expert_major(recv_PL)
        y_TE = experts(recv_TE[perm], recv_PL.sum(dim=0).tolist())
        back_TE = y_TE.new_zeros(y_TE.shape).index_copy(0, perm, y_TE)
        # Outputs travel in their own dtype (bf16/fp16 under autocast, whatever the inputs').
        return dist_fn.all_to_all_single(
            back_TE.new_empty(x_TE.shape), back_TE, send_splits, recv_splits, group=self.group
        )


def _expert_major(counts_PL: torch.Tensor) -> torch.Tensor:
    """Row order that lists every source's rows of local expert 0, then expert 1, ..."""
    counts = counts_PL.tolist()
    flat = [c for row in counts for c in row]
    starts = [0]
    for c in flat[:-1]:
        starts.append(starts[-1] + c)
    local = len(counts[0]) if counts else 0
    index: list[int] = []
    for e in range(local):
        for p in range(len(counts)):
            start = starts[p * local + e]
            index.extend(range(start, start + counts[p][e]))
    return torch.tensor(index, dtype=torch.int64)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[str]:
    """Keep this rank's block of experts in every MoE layer and dispatch with all-to-all.

    Call on a model holding all experts (identical on every rank, e.g. same seed); `ep_mesh` is
    the 1-D mesh of the ranks that split the experts. The expert weights become `Shard(0)`
    DTensors on it (local block: experts [r·X/P, (r+1)·X/P)). Returns the names of the
    parameters that are now expert-parallel (sharded, not replicated).
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError(
            "--expert-model-parallel-size > 1 needs an MoE model (e.g. --model tiny-mixtral)"
        )
    group = ep_mesh.get_group()
    rank = ep_mesh.get_local_rank()
    sharded = []
    for name, moe in layers:
        dispatcher = AllToAllDispatcher(group, moe.config.num_experts)
        experts = moe.experts
        for leaf in EXPERT_LEAVES:
            full = getattr(experts, leaf)
            block = distribute_tensor(full.detach(), ep_mesh, [Shard(0)])
            setattr(experts, leaf, nn.Parameter(block, requires_grad=full.requires_grad))
            sharded.append(f"{name}.experts.{leaf}")
        experts.expert_offset = rank * dispatcher.local
        experts.forward = _local_forward(experts)  # type: ignore[method-assign]
        moe.dispatcher = dispatcher
    return sharded


def _local_forward(experts: Experts) -> Any:
    """`Experts.forward` on the local blocks of the DTensor weights."""

    def forward(x_TE: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # Cast to the compute dtype: FSDP2's mixed precision leaves the (ignored) experts alone.
        gate_up = cast(DTensor, experts.gate_up_proj).to_local().to(x_TE.dtype)
        down = cast(DTensor, experts.down_proj).to_local().to(x_TE.dtype)
        return expert_outputs(x_TE, counts, gate_up, down)

    return forward


def apply_moe_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup) -> int:
    """Form every MoE layer's auxiliary losses from statistics summed over `cp_group`.

    Context-parallel ranks route disjoint sequence chunks of the same micro-batch; the
    load-balancing loss is nonlinear in its statistics (copies and probability per expert), so
    per-chunk losses differ from one process's. Summed over the group (Megatron aggregates over
    the tensor-and-context group; TP ranks here already route the same tokens), every rank forms
    the micro-batch's losses; the z-loss, a per-token mean, is made global alike. Returns the
    number of MoE layers changed.
    """
    layers = moe_layers(model)
    for _, moe in layers:
        moe.reduce_aux_statistics = functools.partial(sum_over_group, group=cp_group)
    return len(layers)


def is_expert_parameter(name: str) -> bool:
    """True for the expert weights that expert parallelism shards (by name)."""
    return any(f".experts.{leaf}" in name for leaf in EXPERT_LEAVES)


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The routed experts' weights of every MoE layer of `model` (not shared experts)."""
    return {p for _, moe in moe_layers(model) for p in moe.experts.parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce_replicated_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum the gradients of the parameters every EP rank holds a copy of (not the experts').

    Use with a loss normalised by the global token count (a sum over ranks, not a mean).
    """
    for name, param in model.named_parameters():
        if param.grad is not None and not is_expert_parameter(name):
            dist.all_reduce(param.grad, group=group)


class ExpertParallelGradSync:
    """Data-parallel gradient reduction of an expert-parallel model's chunks, once per step.

    The loop scales each rank's loss by the size dp of the gradient-averaging group (data x
    context parallel; DDP's convention: the average over those ranks is then the gradient of
    the global loss). Replicated parameters are averaged over `dp_group` (unless FSDP2 does it:
    `replicated=False`); expert gradients, which already sum their ep group's tokens, are
    summed over `edp_group` (the other ranks holding the same experts) and divided by dp
    (Megatron's expert gradient scaling).

    `chunks` are the model (one) or a pipeline rank's stage chunks; `start(chunk)` launches a
    chunk's reductions asynchronously (under `--overlap-grad-reduce`, right after the chunk's
    last backward) and `finish()` launches the rest, waits and writes the results back.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        dp_group: dist.ProcessGroup,
        edp_group: dist.ProcessGroup | None,
        *,
        replicated: bool = True,
    ) -> None:
        self.dp_group, self.edp_group = dp_group, edp_group
        self.dp = dist.get_world_size(dp_group)
        self.chunks: list[tuple[list[nn.Parameter], list[nn.Parameter]]] = []
        seen: set[int] = set()  # a parameter shared by two chunks is reduced once
        for chunk in chunks:
            experts = expert_parameters(chunk)
            trained = [p for p in chunk.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in trained)
            self.chunks.append(
                (
                    [p for p in trained if p in experts],
                    [p for p in trained if p not in experts] if replicated else [],
                )
            )
        # Per launched chunk: (in-flight reduction or None, what to do once it is done).
        self._pending: dict[int, list[tuple[dist.Work | None, Callable[[], object]]]] = {}

    def start(self, chunk: int) -> None:
        """Launch the reductions of chunk `chunk`'s gradients (no-op if already launched)."""
        if chunk in self._pending:
            return
        experts, replicated = self.chunks[chunk]
        pending: list[tuple[dist.Work | None, Callable[[], object]]] = []
        grads = [_local(p.grad) for p in replicated if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
            pending.append((work, functools.partial(_write_mean, flat, grads, self.dp)))
        for param in experts:
            if param.grad is None:
                continue
            grad = _local(param.grad)
            work = None
            if self.edp_group is not None:
                work = dist.all_reduce(grad, group=self.edp_group, async_op=True)
            pending.append((work, functools.partial(grad.div_, self.dp)))
        self._pending[chunk] = pending

    def finish(self) -> None:
        """Reduce this step's accumulated gradients (call after the last backward)."""
        for chunk in range(len(self.chunks)):
            self.start(chunk)
        for pending in self._pending.values():
            for work, done in pending:
                if work is not None:
                    work.wait()
                done()
        self._pending = {}


def _write_mean(flat: torch.Tensor, grads: list[torch.Tensor], size: int) -> None:
    """Copy the summed `flat` buffer, divided by `size`, back into `grads` (in order)."""
    flat.div_(size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class ExpertsTensorParallel(ParallelStyle):
    """Tensor parallelism of every expert in an `Experts` module (Megatron's expert TP).

    Each expert's [gate; up] projection is column-parallel (rank r computes gate and up rows
    [r·F/t, (r+1)·F/t)) and its down projection row-parallel (the matching F/t columns); the
    partial outputs are summed over the TP group. `down_proj` is a `Shard(2)` DTensor (memory
    split); `gate_up_proj` stays whole as a `Replicate` DTensor with each rank computing its
    rows, as `SlicedColwise` does for packed weights, because a [gate; up] row split is not one
    DTensor shard. The router is replicated (the plan's fallback).

    With `sequence_parallel` the experts return their partial outputs unreduced: the layer's
    `MoESequenceParallel` reduce-scatters the combined output over the sequence, and its input
    all-gather reduce-scatters the partial input gradient in backward.
    """

    def __init__(self, ffn: int, *, sequence_parallel: bool) -> None:
        self.ffn = ffn
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Experts):
            raise TypeError(f"ExpertsTensorParallel applies to models.moe.Experts, not {module}")
        if isinstance(module.gate_up_proj, DTensor):
            # Expert-parallel already (`apply_expert_parallel` runs first): each TP rank runs
            # its ep block whole, as Megatron with expert-tensor-parallel size 1.
            return module
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        if self.ffn % size:
            raise ValueError(
                f"--tensor-model-parallel-size {size} does not divide the expert "
                f"ffn_hidden_size={self.ffn}"
            )
        per = self.ffn // size
        rows = torch.cat(
            [
                torch.arange(rank * per, (rank + 1) * per),
                self.ffn + torch.arange(rank * per, (rank + 1) * per),
            ]
        ).to(module.gate_up_proj.device)
        group = device_mesh.get_group()
        for leaf, placement in (("gate_up_proj", Replicate()), ("down_proj", Shard(2))):
            full = getattr(module, leaf)
            dt = distribute_tensor(full.detach(), device_mesh, [placement])
            setattr(module, leaf, nn.Parameter(dt, requires_grad=full.requires_grad))
        partial = self.sequence_parallel

        def forward(x_TE: torch.Tensor, counts: list[int]) -> torch.Tensor:
            gate_up = copy_to_group(cast(DTensor, module.gate_up_proj).to_local(), group)
            down = cast(DTensor, module.down_proj).to_local()
            if partial:
                return expert_outputs(x_TE, counts, gate_up.index_select(1, rows), down)
            # Every rank's rows see the whole input: its gradient is a partial sum over ranks.
            x_TE = copy_to_group(x_TE, group)
            partial_TE = expert_outputs(x_TE, counts, gate_up.index_select(1, rows), down)
            return reduce_from_group(partial_TE, group)

        module.forward = forward  # type: ignore[method-assign]
        return module


class MoESequenceParallel(ParallelStyle):
    """An MoE layer under sequence parallelism: input and output are [B, S/t, E] shards.

    The input is all-gathered over the TP group, as for the dense MLP, and every rank routes the
    whole micro-batch: router logits, top-k, capacity drops, load-balancing and z-loss are one
    process's (the router is replicated). Then, by where the experts live:

    - tensor-parallel experts (`ExpertsTensorParallel`): every rank runs every routed copy through
      its F/t slice of each expert; the per-token combination of those partial outputs is
      reduce-scattered over the sequence (the dense MLP's row-parallel reduce-scatter), and the
      partial input gradient is reduce-scattered in backward;
    - expert-parallel experts (whole on each TP rank): a rank sends only its own sequence
      slice's copies through its ep group and gets its slice's output back, no reduction; the
      experts' gradients are then partial over the TP ranks (see `ExpertParallelGradSync`).

    Either way a rank's routing weights get gradient from only its share of the work, so their
    gradient is summed over the TP group (N·K numbers per layer) before the replicated router's
    backward.

    Shared experts (and their gate) are replicated, as without sequence parallelism, but run on
    this rank's sequence slice only: `apply_tensor_parallel` gives them sequence-sharded DTensor
    inputs, so their weights' gradients are partial and DTensor sums them over the TP group.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoE):
            raise TypeError(f"MoESequenceParallel applies to models.moe.MoE, not {module}")
        group = device_mesh.get_group()
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        whole_experts = isinstance(module.dispatcher, AllToAllDispatcher)

        def forward(x_BsE: torch.Tensor) -> torch.Tensor:
            b, s, e = x_BsE.shape
            full_BSE, partial_BSE = gather_sequence_for_both(x_BsE, group, not whole_experts)
            logits_NX, weights_NK, experts_NK = module.route(full_BSE.reshape(-1, e))
            keep_NK = module.keep_mask(experts_NK)
            weights_NK = copy_to_group(weights_NK, group)
            if whole_experts:
                own = (torch.arange(b)[:, None] * s * size + rank * s + torch.arange(s)).flatten()
                own = own.to(x_BsE.device)
                out_nE = module.routed_experts(
                    x_BsE.reshape(-1, e), weights_NK[own], experts_NK[own], keep_NK[own]
                )
            else:
                assert partial_BSE is not None  # asked for when the experts are split
                out_NE = module.routed_experts(
                    partial_BSE.reshape(-1, e), weights_NK, experts_NK, keep_NK
                )
                out_nE = reduce_scatter_sequence(out_NE.view(b, s * size, e), group)
            out_BsE = out_nE.reshape(b, s, e)
            shared_BsE = module.shared_output(x_BsE)
            if shared_BsE is not None:
                out_BsE = out_BsE + shared_BsE
            return module.attach_aux_loss(out_BsE, module.aux_loss(logits_NX, experts_NK))

        module.forward = forward  # type: ignore[method-assign,assignment]
        return module
