"""Tensor-parallel serving layout: shard a full CausalLM by the model's TP plan (no autograd).

Shapes: B batch, S sequence, E hidden, V vocab; P = V / tp rows of the vocabulary per rank.

`models.parallel_plan.tp_plan(config, sequence_parallel=False)` names each submodule's style;
this module applies it with plain `torch.distributed` collectives on an explicit group:

- colwise (q/k/v, gate/up projections): keep this rank's output rows (its heads / ffn slice);
  packed [q; k; v] and [gate; up] weights are split per part first.
- rowwise (o_proj, down_proj): keep this rank's input columns; all-reduce the partial outputs,
  then add the bias once.
- vocab_parallel_embedding: keep this rank's vocabulary rows; ids outside them look up zeros,
  and an all-reduce sums the ranks' rows.
- colwise_loss_parallel (lm_head): this rank's vocabulary rows; the logits are all-gathered.
  A normalised head (Baichuan2) has its rows normalised once, when sharded.
- alibi_heads: the attention's `head_offset` is the rank's first head.

Every rank ends with identical logits, so replicated engines make identical decisions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.parallel_plan import check_tp_size, match_plan, tp_plan
from models.transformer import Attention, CausalLM


def _chunk(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return tensor.chunk(world, dim=dim)[rank].contiguous()


def _packed_rows(tensor: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """This rank's slice of every part of a row-packed weight, re-packed in the same order."""
    return torch.cat([_chunk(part, 0, rank, world) for part in tensor.split(sizes, dim=0)], dim=0)


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


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


@torch.no_grad()
def shard_for_serving(model: CausalLM, group: dist.ProcessGroup) -> CausalLM:
    """Shard a full CausalLM in place for this rank of `group` (see the module docstring)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    config: ModelConfig = model.config
    check_tp_size(config, world)
    names = [name for name, _ in model.named_modules()]
    plan = match_plan(tp_plan(config, sequence_parallel=False), names)
    q = config.num_attention_heads * config.head_dim
    kv = config.kv_heads * config.head_dim
    f = config.ffn_hidden_size
    embedding_shard = None
    for name, style in plan.items():
        module = model.get_submodule(name)
        if style == "colwise" or style in ("colwise_packed_qkv", "colwise_packed_gate_up"):
            assert isinstance(module, nn.Linear)
            sizes = {"colwise_packed_qkv": [q, kv, kv], "colwise_packed_gate_up": [f, f]}.get(
                style, [module.out_features]
            )
            module.weight = nn.Parameter(
                _packed_rows(module.weight.data, sizes, rank, world), False
            )
            if module.bias is not None:
                module.bias = nn.Parameter(
                    _packed_rows(module.bias.data, sizes, rank, world), False
                )
            module.out_features = module.weight.shape[0]
        elif style == "rowwise":
            assert isinstance(module, nn.Linear)
            _set(model, name, RowParallelLinear(module, group, rank, world))
        elif style == "vocab_parallel_embedding":
            assert isinstance(module, nn.Embedding)
            embedding_shard = VocabParallelEmbedding(module, group, rank, world)
            _set(model, name, embedding_shard)
        elif style == "alibi_heads":
            assert isinstance(module, Attention)
            module.head_offset = rank * (config.num_attention_heads // world)
    if model.lm_head is not None:
        if config.tie_word_embeddings and embedding_shard is not None:
            weight = embedding_shard.weight  # tied: the same vocabulary rows on this rank
        else:
            weight = nn.Parameter(_chunk(model.lm_head.weight.data, 0, rank, world), False)
        if config.norm_head:
            # Baichuan2's NormHead L2-normalises each vocabulary row, and a rank holds whole rows:
            # serving never updates them, so normalise once here (a new tensor: a tied embedding
            # keeps its rows) and run the head as a plain gathered linear from now on.
            weight = nn.Parameter(F.normalize(weight.data, dim=-1), False)
            model.config = config.replace(norm_head=False)
        _set(model, "lm_head", GatheredLMHead(weight, group, world))
    return model
