"""Autograd-aware collectives of tensor, sequence and expert parallelism (Megatron's mappings).

Shapes: B batch, S sequence (s = S/t, a sequence shard over t ranks), E hidden, N rows.

Every function takes the process group it runs on. Each pairs a forward collective with its
adjoint in backward, so that a model-parallel forward computes the gradients one process would:

| function                   | forward                          | backward                          |
| -------------------------- | -------------------------------- | --------------------------------- |
| `copy_to_group`            | identity                         | all-reduce (sum)                  |
| `reduce_from_group`        | all-reduce (sum)                 | identity                          |
| `sum_over_group`           | all-reduce (sum)                 | all-reduce (sum)                  |
| `gather_sequence`          | all-gather along dim 1           | reduce-scatter along dim 1        |
| `reduce_scatter_sequence`  | reduce-scatter along dim 1       | all-gather along dim 1            |
| `gather_sequence_for_both` | all-gather along dim 1, twice    | own slice + reduce-scatter        |
| `gather_rows`              | all-to-all of chosen weight rows | all-to-all back, summed per row   |

The classes are the `torch.autograd.Function`s behind them (public for `isinstance` checks and
for callers that need `.apply`); the functions are the typed entry points.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist


def all_gather_dim1(x_BsE: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's [B, s, E] along dim 1 (rank order): [B, s·t, E]. No autograd."""
    size = dist.get_world_size(group)
    x_sBE = x_BsE.transpose(0, 1).contiguous()
    out_SBE = x_sBE.new_empty((x_sBE.shape[0] * size, *x_sBE.shape[1:]))
    dist.all_gather_single(out_SBE, x_sBE, group=group)
    return out_SBE.transpose(0, 1)


def reduce_scatter_dim1(x_BSE: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum [B, S, E] over the ranks and keep this rank's [B, S/t, E] slice. No autograd."""
    size = dist.get_world_size(group)
    x_SBE = x_BSE.transpose(0, 1).contiguous()
    out_sBE = x_SBE.new_empty((x_SBE.shape[0] // size, *x_SBE.shape[1:]))
    dist.reduce_scatter_single(out_sBE, x_SBE, group=group)
    return out_sBE.transpose(0, 1)


class CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (Megatron's copy-to-region).

    For a tensor every rank uses whole but for different outputs (its columns, its rows of a
    weight, its share of the routed tokens): each rank's gradient is a partial sum.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward: partial outputs of the ranks combined; identity backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward and backward: per-rank sums (e.g. a micro-batch's statistics)
    made the group's, from which every rank forms the same loss L.

    Backward is the adjoint of the sum: the sum of the ranks' identical upstream gradients, i.e.
    group-size x dL/dstats. Each rank injects L, and data-parallel averaging divides the sum of
    the ranks' gradients (each through its own tokens) by the group size too, so the result is
    dL/dθ once, as if one process had formed L.
    """

    @staticmethod
    def forward(ctx: Any, stats: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = stats.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GatherSequence(torch.autograd.Function):
    """[B, S/t, E] shards → the whole [B, S, E]; backward reduce-scatters the partial gradient."""

    @staticmethod
    def forward(ctx: Any, x_BsE: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return all_gather_dim1(x_BsE, group)

    @staticmethod
    def backward(ctx: Any, grad_BSE: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return reduce_scatter_dim1(grad_BSE, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Partial [B, S, E] sums → this rank's [B, S/t, E] of the total (the row-parallel output of
    sequence parallelism); backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, x_BSE: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return reduce_scatter_dim1(x_BSE, group)

    @staticmethod
    def backward(ctx: Any, grad_BsE: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return all_gather_dim1(grad_BsE, ctx.group), None


class GatherSequenceForBoth(torch.autograd.Function):
    """[B, S/t, E] shards → the whole [B, S, E] for a replicated consumer (its gradient is the
    same on every rank: backward keeps this rank's slice) and, `with_partial`, a copy for a
    partial one (each rank's gradient is a partial sum: backward reduce-scatters it); else None.
    One all-gather either way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x_BsE: torch.Tensor, group: dist.ProcessGroup, with_partial: bool
    ) -> Any:
        ctx.group = group
        ctx.rank, ctx.s = dist.get_rank(group), x_BsE.shape[1]
        full_BSE = all_gather_dim1(x_BsE, group)
        return full_BSE, full_BSE.detach().clone() if with_partial else None

    @staticmethod
    def backward(ctx: Any, replicated_BSE: Any, partial_BSE: Any) -> Any:  # type: ignore[override]
        grad = None
        if replicated_BSE is not None:
            grad = replicated_BSE[:, ctx.rank * ctx.s : (ctx.rank + 1) * ctx.s]
        if partial_BSE is not None:
            scattered = reduce_scatter_dim1(partial_BSE, ctx.group)
            grad = scattered if grad is None else grad + scattered
        return grad, None, None


class RowExchange:
    """Who sends which stored rows to whom, for `gather_rows` (fixed per weight shape and rank).

    The weight is stored as DTensor's Shard(0) split (torch.chunk) of `num_rows` rows over `tp`
    ranks; `rows_of_rank(r, tp)` names the global rows rank r computes with.
    """

    def __init__(
        self, rows_of_rank: Callable[[int, int], torch.Tensor], num_rows: int, rank: int, tp: int
    ) -> None:
        # Rank s stores rows [bounds[s], bounds[s+1]).
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

    def to(self, device: torch.device) -> RowExchange:
        """Index tensors on `device` (where the weight lives)."""
        self.send_index = self.send_index.to(device)
        self.recv_order = self.recv_order.to(device)
        return self


class GatherRows(torch.autograd.Function):
    """This rank's rows of a weight stored row-sharded (Shard(0)) over `group`, via all-to-all.

    Forward: every rank sends each other rank the rows it stores that the other one computes
    with; backward sends the row gradients back to their owners, which add them up (a row that
    several ranks use, a replicated KV head, gets the sum of their gradients).
    """

    @staticmethod
    def forward(ctx: Any, shard_NE: torch.Tensor, plan: RowExchange, group: dist.ProcessGroup):  # type: ignore[override]
        ctx.plan, ctx.group, ctx.shard_rows = plan, group, shard_NE.shape[0]
        send = shard_NE.index_select(0, plan.send_index).contiguous()
        received = send.new_empty((plan.recv_order.numel(), *shard_NE.shape[1:]))
        dist.all_to_all_single(received, send, plan.recv_counts, plan.send_counts, group=group)
        return received.index_select(0, plan.recv_order)

    @staticmethod
    def backward(ctx: Any, grad_RE: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        grad_sent = grad_RE.new_empty((plan.recv_order.numel(), *grad_RE.shape[1:]))
        grad_sent.index_copy_(0, plan.recv_order, grad_RE.contiguous())
        grad_back = grad_RE.new_empty((plan.send_index.numel(), *grad_RE.shape[1:]))
        dist.all_to_all_single(
            grad_back, grad_sent, plan.send_counts, plan.recv_counts, group=ctx.group
        )
        grad_shard = grad_RE.new_zeros((ctx.shard_rows, *grad_RE.shape[1:]))
        return grad_shard.index_add_(0, plan.send_index, grad_back), None, None


def copy_to_group(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`tensor` unchanged; its gradient summed over `group` (see `CopyToGroup`)."""
    return cast(torch.Tensor, CopyToGroup.apply(tensor, group))


def reduce_from_group(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `tensor` over `group`; the gradient passes through (see `ReduceFromGroup`)."""
    return cast(torch.Tensor, ReduceFromGroup.apply(tensor, group))


def sum_over_group(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `tensor` over `group`, its gradient summed too (see `SumOverGroup`)."""
    return cast(torch.Tensor, SumOverGroup.apply(tensor, group))


def gather_sequence(x_BsE: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole [B, S, E] from sequence shards (see `GatherSequence`)."""
    return cast(torch.Tensor, GatherSequence.apply(x_BsE, group))


def reduce_scatter_sequence(x_BSE: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's [B, S/t, E] slice of the sum over `group` (see `ReduceScatterSequence`)."""
    return cast(torch.Tensor, ReduceScatterSequence.apply(x_BSE, group))


def gather_sequence_for_both(
    x_BsE: torch.Tensor, group: dist.ProcessGroup, with_partial: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(whole sequence for a replicated consumer, a copy for a partial one or None); see
    `GatherSequenceForBoth`."""
    return cast(
        "tuple[torch.Tensor, torch.Tensor | None]",
        GatherSequenceForBoth.apply(x_BsE, group, with_partial),
    )


def gather_rows(
    shard_NE: torch.Tensor, plan: RowExchange, group: dist.ProcessGroup
) -> torch.Tensor:
    """This rank's rows (in `plan`'s order) of a weight stored row-sharded (see `GatherRows`)."""
    return cast(torch.Tensor, GatherRows.apply(shard_NE, plan, group))


__all__ = [
    "CopyToGroup",
    "GatherRows",
    "GatherSequence",
    "GatherSequenceForBoth",
    "ReduceFromGroup",
    "ReduceScatterSequence",
    "RowExchange",
    "SumOverGroup",
    "all_gather_dim1",
    "copy_to_group",
    "gather_rows",
    "gather_sequence",
    "gather_sequence_for_both",
    "reduce_from_group",
    "reduce_scatter_dim1",
    "reduce_scatter_sequence",
    "sum_over_group",
]
