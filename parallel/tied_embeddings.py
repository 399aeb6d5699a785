"""Tied input embedding and output head under pipeline parallelism (Megatron's embedding group).

The first stage holds `embed_tokens.weight`, the last stage a copy as `lm_head.weight` (made by
`models.pipeline.build_stage`; both start from the same values). Each step, after the schedule,
the two gradients are summed over the embedding group — the first and the last pipeline rank of
each (data, context, tensor) coordinate — so both copies receive the gradient the single tied
matrix would, and the optimizer keeps them equal. When one rank holds both stages (the V
schedules put stage 0 and stage 2P-1 on pipeline rank 0) the two chunks simply share one
parameter and autograd adds the contributions.

Checkpoints keep one global name: a rank holding only the copy exposes it as
`embed_tokens.weight` as well (see `PipelineRankModel`), as the single-process tied model does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param.grad`'s local tensor laid out like `param` (placements made to match first)."""
    grad = param.grad
    if grad is None:
        return None
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        if grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
            param.grad = grad
        return grad.to_local()
    return grad


def share_on_rank(chunks: Sequence[tuple[Any, Any]]) -> bool:
    """Tie the last stage's head to the first stage's embedding when this rank holds both."""
    first = next((c for s, c in chunks if s.has_embedding), None)
    last = next((c for s, c in chunks if s.has_head), None)
    if first is None or last is None or first is last:
        return False
    assert first.embed_tokens is not None and last.lm_head is not None
    last.lm_head.weight = first.embed_tokens.weight
    return True


class EmbeddingGroup:
    """Sums the tied embedding/head gradients of the first and the last pipeline rank.

    `first_rank` and `last_rank` are the pipeline coordinates holding stage 0 and the last stage
    (different ranks). The group is built with local synchronization: only its two members
    create it, so ranks of other coordinates need not take part.
    """

    def __init__(
        self, param: nn.Parameter | None, dims: Any, first_rank: int, last_rank: int
    ) -> None:
        self.param = param
        self.copy = param if dims.coordinate("pp") == last_rank else None
        self.group: dist.ProcessGroup | None = None
        pp_group = dims.submesh("pp").get_group()
        me = dist.get_rank(pp_group)
        if me in (first_rank, last_rank):
            assert param is not None, "a first or last pipeline stage holds the tied weight"
            members = sorted(dist.get_global_rank(pp_group, r) for r in (first_rank, last_rank))
            self.group = dist.new_group(members, use_local_synchronization=True)

    @classmethod
    def build(
        cls, chunks: Sequence[tuple[Any, Any]], dims: Any, last_rank: int
    ) -> EmbeddingGroup | None:
        """The group for this rank's chunks (stage ranges, modules) of a tied model, or None
        (untied, or stage 0 and the last stage on one rank: `share_on_rank` tied them)."""
        first_rank = 0
        config = chunks[0][1].config
        if not config.tie_word_embeddings or first_rank == last_rank:
            return None
        param = None
        for stage, chunk in chunks:
            if stage.has_embedding:
                param = chunk.embed_tokens.weight
            elif stage.has_head:
                param = chunk.lm_head.weight
        return cls(param, dims, first_rank, last_rank)

    def all_reduce(self) -> None:
        """Sum the tied gradient over the group (no-op on ranks outside it)."""
        if self.group is None or self.param is None:
            return
        grad = _local_grad(self.param)
        if grad is None:
            # A stage whose tied weight got no gradient this step still contributes zeros.
            grad = torch.zeros_like(_local_grad_template(self.param))
            dist.all_reduce(grad, group=self.group)
            self.param.grad = _as_param_grad(self.param, grad)
            return
        dist.all_reduce(grad, group=self.group)


def _local_grad_template(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _as_param_grad(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local
