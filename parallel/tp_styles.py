"""Tensor-parallel training styles of Meshline's own (DTensor `ParallelStyle`s beside torch's).

The registry that maps plan style names to these (and to the serving layouts) is
`parallel.tp_registry.TP_STYLES`; `parallel.tensor_parallel.apply_tensor_parallel` applies it.

Packed projections ([q; k; v], [gate; up]) and KV heads beyond the TP size are `SlicedColwise`:
a rank computes with rows that are not one contiguous block (its q, k and v heads; its gate and
up halves), so the weight is stored as a plain Shard(0) DTensor in its global row order (1/tp of
the memory; checkpoints keep the global name, shape and order, so they move between layouts) and
each forward gathers the rank's rows with one all-to-all, whose backward returns the row
gradients to their owners. Megatron instead stores the rows permuted per rank and converts on
checkpointing; a 1-D `_StridedShard` would describe [gate; up] and MHA qkv but not GQA's unequal
parts, and DCP records one contiguous chunk per DTensor shard, which a strided shard is not.
`row_selectors` says which rows a rank computes with; serving keeps exactly those rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from models.config import ModelConfig
from parallel.collectives import RowExchange, copy_to_group, gather_rows

RowsOfRank = Callable[[int, int], torch.Tensor]
"""(rank, tp) -> the global rows of a weight that `rank` computes with."""


def packed_rows(parts: list[tuple[int, int]], head_dim: int) -> RowsOfRank:
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


def row_selectors(config: ModelConfig) -> dict[str, RowsOfRank]:
    """Styles whose rank rows are not one contiguous block -> the rows a rank computes with."""
    h, k, d = config.num_attention_heads, config.kv_heads, config.head_dim
    f = config.ffn_hidden_size
    return {
        "colwise_packed_qkv": packed_rows([(h, h), (k, k), (k, k)], d),
        "colwise_packed_gate_up": packed_rows([(f, 0), (f, 0)], 1),
        "kv_replicated": packed_rows([(k, k)], d),
    }


class SlicedColwise(ParallelStyle):
    """Column-parallel over chosen rows (`rows_of_rank`) of a weight stored row-sharded.

    The weight and bias are Shard(0) DTensors in their global row order (1/tp of the memory
    per rank; a checkpoint holds the unsharded layout under the same name and shape, so it moves
    between layouts). Each forward gathers the rows this rank computes with an all-to-all
    (`parallel.collectives.gather_rows`): about 1/tp of the weight crosses the group per rank,
    and the same for its gradient in backward.
    """

    def __init__(self, rows_of_rank: RowsOfRank) -> None:
        self.rows_of_rank = rows_of_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear), "SlicedColwise applies to nn.Linear"
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        plan = RowExchange(self.rows_of_rank, module.out_features, rank, size)
        plan.to(module.weight.device)
        group = device_mesh.get_group()
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)])
            assert sharded.to_local().shape[0] == plan.stored_rows, "Shard(0) split mismatch"
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight: torch.Tensor = cast(DTensor, module.weight).to_local()
            bias: torch.Tensor | None = module.bias
            if bias is not None:
                # One exchange for both: the bias travels as an extra column.
                local_bias = cast(DTensor, bias).to_local()
                packed = torch.cat([weight, local_bias.unsqueeze(1)], dim=1)
                packed = gather_rows(packed, plan, group)
                weight, bias = packed[:, :-1], packed[:, -1]
            else:
                weight = gather_rows(weight, plan, group)
            # Each rank's rows see the whole input: its gradient is a partial sum over ranks.
            x = copy_to_group(x, group)
            return F.linear(x, weight, bias)

        module.forward = forward  # type: ignore[method-assign,assignment]
        return module
