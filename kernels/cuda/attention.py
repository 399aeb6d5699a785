"""flash-attn backend for CUDA (Dao et al., `flash_attn_func` / `flash_attn_varlen_func`).

Shapes: B batch, S sequence, H heads, K kv heads, D head dim; flash-attn takes BSHD directly
and handles GQA/MQA itself. Its causal mask is bottom-right aligned (flash-attn >= 2.1), which is
our default q_offset = Sk - Sq. Packed documents go through the varlen kernel with one
sequence per run of equal segment ids. Requests it cannot express decline with the reason
(fp32 inputs, key padding masks, other q_offsets, ALiBi without causality, a differentiable lse)
and the dispatcher falls back to SDPA.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_func, flash_attn_varlen_func

from kernels.attention.spec import AttentionSpec, Unsupported


def _check(q_BSHD: torch.Tensor, spec: AttentionSpec) -> None:
    if q_BSHD.dtype not in (torch.float16, torch.bfloat16):
        raise Unsupported(f"flash-attn needs fp16/bf16 inputs, got {q_BSHD.dtype}")
    if spec.key_padding_mask_BS is not None:
        raise Unsupported("key padding masks are not mapped onto flash-attn")
    if spec.causal and spec.q_offset != spec.k_len - spec.q_len:
        raise Unsupported("flash-attn's causal mask is bottom-right aligned only")
    if spec.alibi_slopes_H is not None and not spec.causal:
        raise Unsupported("flash-attn's bidirectional ALiBi uses -|i - j|, not (j - i)")
    if spec.return_lse and torch.is_grad_enabled():
        raise Unsupported("flash-attn's softmax_lse is not differentiable")
    if spec.window is not None:
        raise Unsupported("sliding windows are not mapped onto flash-attn's window_size yet")


def attention_flash(
    q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out_BSHD, lse_BHS or None) from flash-attn."""
    _check(q_BSHD, spec)
    slopes = None if spec.alibi_slopes_H is None else spec.alibi_slopes_H.float()
    if spec.segment_ids_BS is None:
        res = flash_attn_func(
            q_BSHD,
            k_BSKD,
            v_BSKD,
            dropout_p=spec.dropout_p,
            softmax_scale=spec.scale,
            causal=spec.causal,
            alibi_slopes=slopes,
            return_attn_probs=spec.return_lse,
        )
        if not spec.return_lse:
            return res, None
        out, lse, _ = res
        return out, lse.float()
    cu_seqlens, max_len = _cu_seqlens_from_segments(spec.segment_ids_BS)
    B, S, H, D = q_BSHD.shape
    res = flash_attn_varlen_func(
        q_BSHD.reshape(B * S, H, D),
        k_BSKD.reshape(B * S, spec.kv_heads, D),
        v_BSKD.reshape(B * S, spec.kv_heads, D),
        cu_seqlens,
        cu_seqlens,
        max_len,
        max_len,
        dropout_p=spec.dropout_p,
        softmax_scale=spec.scale,
        causal=spec.causal,
        alibi_slopes=slopes,
        return_attn_probs=spec.return_lse,
    )
    if not spec.return_lse:
        return res.view(B, S, H, D), None
    out, lse_HT, _ = res
    return out.view(B, S, H, D), lse_HT.float().view(H, B, S).transpose(0, 1)


def _cu_seqlens_from_segments(segment_ids_BS: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int32 boundaries of runs of equal segment ids over the flattened batch, and the longest."""
    B, S = segment_ids_BS.shape
    starts = torch.ones(B, S, dtype=torch.bool, device=segment_ids_BS.device)
    starts[:, 1:] = segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]
    start_idx = torch.nonzero(starts.flatten(), as_tuple=True)[0]
    cu = torch.cat([start_idx, torch.tensor([B * S], device=start_idx.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())
