"""Context parallelism: ring attention over a `cp` group, with causal load balancing.

Shapes: B batch, S sequence (local: S/cp), H heads, K kv heads, D head dim; c = S/(2·cp).

The sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp-1-r (mirrored pairs),
so under the causal mask every rank does the same work. Each rank's key/value block travels
around the ring with P2P send/recv (cp-1 hops); every (query chunk, key chunk) pair is attended
with the kernels' attention (`return_lse=True`): a key chunk before the query chunk is fully
visible, the same chunk is causal, a later one is skipped. Partial outputs are merged by their
log-sum-exp. ALiBi biases use global positions: the block of query chunk q against key chunk
k is attended with `q_offset` (q - k)·c. Backward is autograd's: each hop's backward sends the
key/value gradient back the other way around the ring, so every rank ends with the gradient of
its own keys and values.
Memory: a rank keeps the K/V blocks it received (cp blocks) for backward; queries, outputs and all
other activations stay sharded.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels.attention import attention
from services.trainer.parallel.parallel_dims import check_seq_length


class _RingPass(torch.autograd.Function):
    """Send to the next rank of the ring, receive from the previous; backward goes the other way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _exchange(tensor, group, step=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _exchange(grad, ctx.group, step=-1), None


def _exchange(tensor: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send `tensor` to rank (r+step) of `group` and return what rank (r-step) sent."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send_to = dist.get_global_rank(group, (rank + step) % size)
    recv_from = dist.get_global_rank(group, (rank - step) % size)
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, send_to, group),
        dist.P2POp(dist.irecv, received, recv_from, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two global sequence chunks (of 2·cp) that context-parallel rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x_BS: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced part of a full-sequence tensor: chunks r and 2·cp-1-r along `dim`."""
    check_seq_length(x_BS.shape[dim], cp)
    chunks = x_BS.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def ring_attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    softmax_scale: float | None = None,
    alibi_slopes_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's load-balanced query chunks over the whole ring's keys.

    With `alibi_slopes_H` each (query chunk, key chunk) block is biased by the global distance:
    chunk q starts (q - k)·c positions after chunk k, which is the kernels' `q_offset`.
    """
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    c = q_BSHD.shape[1] // 2
    kv_2BSKD = torch.stack([k_BSKD, v_BSKD])
    blocks = [(kv_2BSKD, rank)]
    for hop in range(1, cp):
        kv_2BSKD = _RingPass.apply(kv_2BSKD, group)
        blocks.append((kv_2BSKD, (rank - hop) % cp))
    outputs = []
    for q_half, q_chunk in zip(q_BSHD.split(c, dim=1), chunk_ids(rank, cp), strict=True):
        parts = []
        for kv, source in blocks:
            for kv_half, k_chunk in zip(kv.split(c, dim=2), chunk_ids(source, cp), strict=True):
                if k_chunk > q_chunk:
                    continue
                # An earlier key chunk is wholly visible under the causal rule at this offset.
                alibi = alibi_slopes_H is not None
                out_BSHD, lse_BHS = attention(
                    q_half,
                    kv_half[0],
                    kv_half[1],
                    causal=alibi or k_chunk == q_chunk,
                    softmax_scale=softmax_scale,
                    alibi_slopes_H=alibi_slopes_H,
                    q_offset=(q_chunk - k_chunk) * c if alibi else None,
                    return_lse=True,
                )
                parts.append((out_BSHD, lse_BHS))
        outputs.append(_merge(parts))
    return torch.cat(outputs, dim=1)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets by their log-sum-exps."""
    lse_PBHS = torch.stack([lse for _, lse in parts])
    total_BHS = torch.logsumexp(lse_PBHS, dim=0)
    out = None
    for out_BSHD, lse_BHS in parts:
        weight_BSH1 = torch.exp(lse_BHS - total_BHS).transpose(1, 2).unsqueeze(-1)
        term = out_BSHD.float() * weight_BSH1
        out = term if out is None else out + term
    assert out is not None
    return out.to(parts[0][0].dtype)


def _ring_forward(
    self: Any,
    x_BSE: torch.Tensor,
    rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    key_padding_mask_BS: torch.Tensor | None,
    segment_ids_BS: torch.Tensor | None,
    cache: object,
) -> torch.Tensor:
    """`models.transformer.Attention.forward` with ring attention (training: no cache/masks)."""
    if cache is not None or key_padding_mask_BS is not None or segment_ids_BS is not None:
        raise ValueError(
            "context parallelism supports plain causal training batches: no KV cache, padding "
            "mask or packed segment ids (turn off packing/variable lengths or use "
            "--context-parallel-size 1)"
        )
    q_BSHD, k_BSKD, v_BSKD = self._project(x_BSE, rope_cos_sin)
    slopes_H = self.alibi_slopes_H(q_BSHD.shape[2], q_BSHD.device) if self.alibi else None
    out_BSHD = ring_attention(q_BSHD, k_BSKD, v_BSKD, self._cp_group, alibi_slopes_H=slopes_H)
    return self.o_proj(out_BSHD.flatten(2))


def apply_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup) -> int:
    """Route every attention module of `model` through ring attention over `cp_group`.

    The model must then be fed this rank's `shard_sequence` of every [B, S] input, position ids
    included (positions stay global). Returns the number of attention modules changed.
    """
    from models.transformer import Attention

    changed = 0
    for module in model.modules():
        if isinstance(module, Attention):
            if module.dropout > 0:
                raise ValueError("--context-parallel-size > 1 needs --attention-dropout 0")
            module._cp_group = cp_group  # type: ignore[assignment]
            module.forward = types.MethodType(_ring_forward, module)  # type: ignore[method-assign]
            changed += 1
    return changed
