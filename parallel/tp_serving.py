"""The serving registry of tensor-parallel styles: plan style name -> plain-tensor layout.

Shapes: B batch, S sequence, E hidden, V vocab; P = V / tp rows of the vocabulary per rank.

Serving runs without autograd and without DTensor dispatch: each style keeps this rank's plain
slice of the weights and runs explicit `torch.distributed` collectives on the TP group. The
rows a rank keeps are the rows its training style computes with (`parallel.tp_styles`), so a
served shard equals the training shard; `parallel.tensor_parallel.apply_tensor_parallel(...,
mode="serve")` reads the plan and calls these.

- colwise (q/k/v, gate/up projections): keep this rank's output rows (its heads / ffn slice);
  packed [q; k; v] and [gate; up] weights keep the rows of `row_selectors` (per part).
- rowwise (o_proj, down_proj): keep this rank's input columns; all-reduce the partial outputs,
  then add the bias once.
- vocab_parallel_embedding: keep this rank's vocabulary rows; ids outside them look up zeros,
  and an all-reduce sums the ranks' rows.
- colwise_loss_parallel (lm_head): this rank's vocabulary rows; the logits are all-gathered.
  A normalised head (Baichuan2) has its rows normalised once, when sharded.
- moe_experts: experts stay whole on every rank (each rank computes the whole MoE output).

Every rank ends with identical logits, so replicated engines make identical decisions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from parallel.tp_styles import row_selectors


def _chunk(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return tensor.chunk(world, dim=dim)[rank].contiguous()


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b, with W split along its input dimension."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, rank: int, world: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(_chunk(linear.weight.data, 1, rank, world), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data, False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output on every rank."""
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [rank·P, (rank+1)·P) live on this rank; outputs summed over ranks."""

    def __init__(
        self, embedding: nn.Embedding, group: dist.ProcessGroup, rank: int, world: int
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(_chunk(embedding.weight.data, 0, rank, world), False)
        self.start = rank * self.weight.shape[0]
        self.group = group

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, S, E] of token ids, identical on every rank."""
        local_BS = ids_BS - self.start
        outside_BS = (local_BS < 0) | (local_BS >= self.weight.shape[0])
        h_BSE = F.embedding(local_BS.masked_fill(outside_BS, 0), self.weight)
        h_BSE = h_BSE.masked_fill(outside_BS[..., None], 0.0)
        dist.all_reduce(h_BSE, group=self.group)
        return h_BSE


class GatheredLMHead(nn.Module):
    """Output head over this rank's vocabulary rows; logits all-gathered to [B, S, V]."""

    def __init__(self, weight: nn.Parameter, group: dist.ProcessGroup, world: int) -> None:
        super().__init__()
        self.weight = weight
        self.group = group
        self.world = world

    def forward(self, h_BSE: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank."""
        return self.gather(F.linear(h_BSE, self.weight))

    def gather(self, local_BSP: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's vocabulary slice along the last dimension."""
        parts = [torch.empty_like(local_BSP) for _ in range(self.world)]
        dist.all_gather(parts, local_BSP.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


ServingLayout = Callable[["ServingShard", str, nn.Module], None]
"""Lays out one module for serving on this rank (sliced or swapped in place)."""


class ServingShard:
    """Applies serving layouts to one model for this rank of `group` (state: the embedding
    shard, which a tied output head reuses)."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        group: dist.ProcessGroup,
        rank: int,
        world: int,
    ) -> None:
        self.model, self.config = model, config
        self.group, self.rank, self.world = group, rank, world
        self.rows = row_selectors(self.config)
        self.embedding: VocabParallelEmbedding | None = None

    @torch.no_grad()
    def apply(self, resolved: dict[str, str], layouts: dict[str, ServingLayout | None]) -> None:
        """Lay out every module of `resolved` (module name -> style, in plan order) with
        `layouts` (style -> layout: `parallel.tp_registry`'s serving column)."""
        for name, style in resolved.items():
            layout = layouts.get(style)
            if layout is None:
                raise ValueError(
                    f"tensor-parallel serving has no layout for plan style {style!r} (module "
                    f"{name}); serve with --tensor-parallel-size 1 or give the style a serving "
                    "layout in parallel.tp_registry.TP_STYLES"
                )
            layout(self, name, self.model.get_submodule(name))

    def replace(self, name: str, module: nn.Module) -> None:
        """Put `module` at `name` in the model."""
        parent_name, _, leaf = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, leaf, module)


def _keep_rows(shard: ServingShard, rows: torch.Tensor | None, module: nn.Module) -> None:
    """Keep `rows` of a linear's weight and bias (None: this rank's contiguous chunk)."""
    assert isinstance(module, nn.Linear)
    for leaf in ("weight", "bias"):
        full = getattr(module, leaf)
        if full is None:
            continue
        if rows is None:
            kept = _chunk(full.data, 0, shard.rank, shard.world)
        else:
            kept = full.data.index_select(0, rows.to(full.device))
        setattr(module, leaf, nn.Parameter(kept, requires_grad=False))
    module.out_features = module.weight.shape[0]


def colwise_layout(shard: ServingShard, name: str, module: nn.Module) -> None:
    _keep_rows(shard, None, module)


def sliced_layout(style: str) -> ServingLayout:
    def layout(shard: ServingShard, name: str, module: nn.Module) -> None:
        _keep_rows(shard, shard.rows[style](shard.rank, shard.world), module)

    return layout


def rowwise_layout(shard: ServingShard, name: str, module: nn.Module) -> None:
    assert isinstance(module, nn.Linear)
    shard.replace(name, RowParallelLinear(module, shard.group, shard.rank, shard.world))


def embedding_layout(shard: ServingShard, name: str, module: nn.Module) -> None:
    assert isinstance(module, nn.Embedding)
    shard.embedding = VocabParallelEmbedding(module, shard.group, shard.rank, shard.world)
    shard.replace(name, shard.embedding)


def lm_head_layout(shard: ServingShard, name: str, module: nn.Module) -> None:
    assert isinstance(module, nn.Linear)
    config = shard.config
    if config.tie_word_embeddings and shard.embedding is not None:
        weight = shard.embedding.weight  # tied: the same vocabulary rows on this rank
    else:
        weight = nn.Parameter(_chunk(module.weight.data, 0, shard.rank, shard.world), False)
    if config.norm_head:
        # Baichuan2's NormHead L2-normalises each vocabulary row, and a rank holds whole rows:
        # serving never updates them, so normalise once here (a new tensor: a tied embedding
        # keeps its rows) and run the head as a plain gathered linear from now on.
        weight = nn.Parameter(F.normalize(weight.data, dim=-1), False)
        shard.config = config.replace(norm_head=False)
        shard.model.config = shard.config  # type: ignore[assignment]
    shard.replace(name, GatheredLMHead(weight, shard.group, shard.world))


def whole_layout(shard: ServingShard, name: str, module: nn.Module) -> None:
    """Kept whole on every rank (every rank computes the module's whole output)."""
