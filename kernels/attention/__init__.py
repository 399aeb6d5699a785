"""Attention: one entry point, a dense reference, and backends chosen per device.

Layout BSHD everywhere (B batch, S sequence, H query heads, K kv heads, D head dim).
Backends: "reference" (dense fp32), "sdpa" (torch SDPA; CPU flash kernel when the lse is
needed), "blockwise" (online softmax skipping masked blocks: `--triangle-attn`), "flash"
(flash-attn on CUDA), "npu" (torch_npu.npu_fusion_attention). A backend that cannot express a
request (say flash-attn with a padding mask) declines it and the next candidate for the device
runs; an explicit `backend=` that declines raises instead.
"""

from __future__ import annotations

import torch

from kernels import registry
from kernels.attention.blockwise import attention_blockwise
from kernels.attention.helpers import (
    alibi_slopes,
    segment_ids_from_cu_seqlens,
    segment_ids_from_position_ids,
)
from kernels.attention.reference import attention_reference
from kernels.attention.sdpa import attention_sdpa
from kernels.attention.spec import AttentionSpec, Unsupported, build_spec

__all__ = [
    "ATTENTION",
    "AttentionSpec",
    "Unsupported",
    "alibi_slopes",
    "attention",
    "segment_ids_from_cu_seqlens",
    "segment_ids_from_position_ids",
]

ATTENTION = registry.define("attention", attention_reference)
ATTENTION.register("flash", ("cuda",), "kernels.cuda.attention:attention_flash")
ATTENTION.register("npu", ("npu",), "kernels.npu.attention:attention_npu")
ATTENTION.register("fused", ("cpu",), "kernels.cpu.fused:attention")
ATTENTION.register("sdpa", ("cpu", "cuda"), attention_sdpa)
ATTENTION.register("blockwise", ("cpu", "cuda", "npu"), attention_blockwise)


def _order(backend: str | None) -> list[str]:
    if backend is not None:
        return [backend]
    chosen = ATTENTION.default()
    candidates = ATTENTION.candidates()
    if chosen not in candidates:
        return [chosen]
    return candidates[candidates.index(chosen) :]


def attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    alibi_slopes_H: torch.Tensor | None = None,
    key_padding_mask_BS: torch.Tensor | None = None,
    segment_ids_BS: torch.Tensor | None = None,
    q_offset: int | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    window: int | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention of q [B,Sq,H,D] over k/v [B,Sk,K,D] (H a multiple of K).

    causal: key j visible to query i iff j <= i + q_offset (q_offset defaults to Sk - Sq, the
    bottom-right alignment KV-cache decoding needs). softmax_scale defaults to 1/sqrt(D).
    alibi_slopes_H adds slope·(j - (i + q_offset)). key_padding_mask_BS is bool over keys,
    True = real token. segment_ids_BS (needs Sq == Sk) keeps attention within packed
    documents. window W (causal only) keeps the last W keys of each query, itself included
    (Mistral's sliding window). dropout_p is applied to the attention probabilities (pass 0 in eval).
    Returns out [B,Sq,H,D] in q's dtype, and with return_lse also lse [B,H,Sq] (fp32, natural
    log; -inf for queries that see no key, whose output is 0). `backend` overrides the choice.
    """
    spec = build_spec(
        q_BSHD,
        k_BSKD,
        v_BSKD,
        causal=causal,
        softmax_scale=softmax_scale,
        alibi_slopes_H=alibi_slopes_H,
        key_padding_mask_BS=key_padding_mask_BS,
        segment_ids_BS=segment_ids_BS,
        q_offset=q_offset,
        dropout_p=dropout_p,
        return_lse=return_lse,
        window=window,
    )
    reasons = []
    for name in _order(backend):
        try:
            out, lse = ATTENTION.get(name)(q_BSHD, k_BSKD, v_BSKD, spec)
        except Unsupported as exc:
            if backend is not None:
                raise ValueError(
                    f"attention backend {backend!r} cannot run this call: {exc}"
                ) from None
            reasons.append(f"{name}: {exc}")
            continue
        return (out, lse) if return_lse else out
    raise AssertionError(f"no attention backend accepted the call ({'; '.join(reasons)})")
