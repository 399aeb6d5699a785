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
other activations stay sharded. Packed documents (segment ids) and key padding masks travel with
the keys; an earlier key chunk is masked per key and per query (`_cross_chunk_masks`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels.attention import attention
from models.transformer import Attention
from parallel.parallel_dims import check_seq_length


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
    key_padding_mask_BS: torch.Tensor | None = None,
    segment_ids_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's load-balanced query chunks over the whole ring's keys.

    With `alibi_slopes_H` each (query chunk, key chunk) block is biased by the global distance:
    chunk q starts (q - k)·c positions after chunk k, which is the kernels' `q_offset`.
    `key_padding_mask_BS` (True = real key) and `segment_ids_BS` (packed documents) are this
    rank's shards, like q; they travel around the ring with the keys (see `_cross_chunk_masks`).
    """
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    c = q_BSHD.shape[1] // 2
    b, s = q_BSHD.shape[:2]
    kv_2BSKD = torch.stack([k_BSKD, v_BSKD])
    # Key-side metadata: [real key, segment id] per position (all real, one segment if absent).
    meta_2BS = torch.stack(
        [
            torch.ones(b, s, dtype=torch.long, device=q_BSHD.device)
            if key_padding_mask_BS is None
            else key_padding_mask_BS.long(),
            torch.zeros(b, s, dtype=torch.long, device=q_BSHD.device)
            if segment_ids_BS is None
            else segment_ids_BS.long(),
        ]
    )
    masked = key_padding_mask_BS is not None or segment_ids_BS is not None
    blocks = [(kv_2BSKD, meta_2BS, rank)]
    for hop in range(1, cp):
        kv_2BSKD = _RingPass.apply(kv_2BSKD, group)
        if masked:
            meta_2BS = _exchange(meta_2BS, group, step=1)
        blocks.append((kv_2BSKD, meta_2BS, (rank - hop) % cp))
    alibi = alibi_slopes_H is not None
    outputs = []
    q_segments = blocks[0][1][1].split(c, dim=1)
    for q_half, q_chunk, q_seg_BS in zip(
        q_BSHD.split(c, dim=1), chunk_ids(rank, cp), q_segments, strict=True
    ):
        parts = []
        for kv, meta, source in blocks:
            for kv_half, meta_half, k_chunk in zip(
                kv.split(c, dim=2), meta.split(c, dim=2), chunk_ids(source, cp), strict=True
            ):
                if k_chunk > q_chunk:
                    continue
                same_chunk = k_chunk == q_chunk
                key_mask_BS, query_ok_BS = None, None
                if masked:
                    key_mask_BS, query_ok_BS = _cross_chunk_masks(
                        meta_half[0].bool(), meta_half[1], q_seg_BS, same_chunk
                    )
                # An earlier key chunk is wholly visible under the causal rule at this offset.
                out_BSHD, lse_BHS = attention(
                    q_half,
                    kv_half[0],
                    kv_half[1],
                    causal=alibi or same_chunk,
                    softmax_scale=softmax_scale,
                    alibi_slopes_H=alibi_slopes_H,
                    key_padding_mask_BS=key_mask_BS,
                    segment_ids_BS=q_seg_BS if masked and same_chunk else None,
                    q_offset=(q_chunk - k_chunk) * c if alibi else None,
                    return_lse=True,
                )
                if query_ok_BS is not None:
                    # Queries of other documents see none of these keys.
                    lse_BHS = lse_BHS.masked_fill(~query_ok_BS[:, None, :], float("-inf"))
                parts.append((out_BSHD, lse_BHS))
        outputs.append(_merge(parts))
    return torch.cat(outputs, dim=1)


def _cross_chunk_masks(
    real_key_BS: torch.Tensor,
    key_seg_BS: torch.Tensor,
    query_seg_BS: torch.Tensor,
    same_chunk: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(key mask, query mask or None) of one (query chunk, earlier key chunk) block.

    The kernels take one segment-id tensor for queries and keys of the same positions. For a
    key chunk before the query chunk, a document is one run of positions, so the only document
    that can hold keys there and queries here is the key chunk's last: keys of that document
    are visible to queries of that document, and everything else is masked — a key mask times a
    query mask. A segment id used by two separate runs would break this and is refused.
    """
    if same_chunk:
        return real_key_BS, None
    last_BS1 = key_seg_BS[:, -1:]
    key_ok_BS, query_ok_BS = key_seg_BS == last_BS1, query_seg_BS == last_BS1
    same_BQK = query_seg_BS[:, :, None] == key_seg_BS[:, None, :]
    if not torch.equal(same_BQK, query_ok_BS[:, :, None] & key_ok_BS[:, None, :]):
        raise ValueError(
            "segment_ids under --context-parallel-size > 1 must give each document one run of "
            "positions (an id reused after another document is not supported); renumber the "
            "packed documents"
        )
    return real_key_BS & key_ok_BS, query_ok_BS


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets by their log-sum-exps.

    A query that sees no key in any part (padding) gets zeros, as from the kernels.
    """
    lse_PBHS = torch.stack([lse for _, lse in parts])
    seen_BHS = torch.isfinite(lse_PBHS).any(dim=0)
    # logsumexp over all -inf has a NaN gradient: such rows sum zeros instead (their weights
    # below are exp(-inf) = 0 either way).
    total_BHS = torch.logsumexp(lse_PBHS.masked_fill(~seen_BHS, 0.0), dim=0)
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
    """`models.transformer.Attention.forward` with ring attention (training: no KV cache)."""
    if cache is not None:
        raise ValueError(
            "context parallelism runs training batches: no KV cache (generate with "
            "--context-parallel-size 1)"
        )
    q_BSHD, k_BSKD, v_BSKD = self._project(x_BSE, rope_cos_sin)
    slopes_H = self.alibi_slopes_H(q_BSHD.shape[2], q_BSHD.device) if self.alibi else None
    out_BSHD = ring_attention(
        q_BSHD,
        k_BSKD,
        v_BSKD,
        self._cp_group,
        alibi_slopes_H=slopes_H,
        key_padding_mask_BS=key_padding_mask_BS,
        segment_ids_BS=segment_ids_BS,
    )
    return self.o_proj(out_BSHD.flatten(2))


def apply_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup) -> int:
    """Route every attention module of `model` through ring attention over `cp_group`.

    The model must then be fed this rank's `shard_sequence` of every [B, S] input, position ids
    included (positions stay global). Returns the number of attention modules changed.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, Attention):
            if module.dropout > 0:
                raise ValueError("--context-parallel-size > 1 needs --attention-dropout 0")
            module._cp_group = cp_group  # type: ignore[assignment]
            module.forward = types.MethodType(_ring_forward, module)  # type: ignore[method-assign]
            changed += 1
    return changed
