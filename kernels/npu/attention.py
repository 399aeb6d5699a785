"""torch_npu's fused attention (`npu_fusion_attention`) on Ascend NPUs.

Shapes: B batch, S sequence, H heads, K kv heads, D head dim; input_layout "BSND" takes BSHD
and GQA/MQA directly. The op computes Dropout(Softmax(Mask(scale·(pse + q·kᵀ)))) · v with
atten_mask True = hidden (our mask inverted), so ALiBi is passed as pse = bias / scale. The
plain causal case uses sparse_mode 3 (bottom-right causal) with the 2048x2048 upper-triangular
mask the op documents; everything else passes the dense mask with sparse_mode 0. The softmax
statistics it returns (softmax_max, softmax_sum, repeated 8 times on the last dim) give the
lse, but not differentiably, so a differentiable lse declines to the block-wise backend.
"""

from __future__ import annotations

import torch
import torch_npu  # registers the npu_* ops on import

from kernels.attention.spec import AttentionSpec, Unsupported

_CAUSAL_MASK_SIZE = 2048
_NO_LIMIT = 2147483647


def attention_npu(
    q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out_BSHD, lse_BHS or None) from npu_fusion_attention."""
    if q_BSHD.dtype not in (torch.float16, torch.bfloat16):
        raise Unsupported(f"npu_fusion_attention needs fp16/bf16 inputs, got {q_BSHD.dtype}")
    if spec.return_lse and torch.is_grad_enabled():
        raise Unsupported("npu_fusion_attention's softmax statistics are not differentiable")
    plain_causal = (
        spec.causal
        and spec.q_offset == spec.k_len - spec.q_len
        and spec.key_padding_mask_BS is None
        and spec.segment_ids_BS is None
        and spec.window is None
    )
    atten_mask: torch.Tensor | None
    if plain_causal:
        atten_mask = torch.ones(
            _CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE, dtype=torch.bool, device=q_BSHD.device
        ).triu(1)
        sparse_mode = 3
    else:
        visible = spec.visible(0, spec.q_len, 0, spec.k_len)
        atten_mask = None if visible is None else ~visible
        sparse_mode = 0
    bias = spec.bias(0, spec.q_len, 0, spec.k_len)
    pse = None if bias is None else (bias / spec.scale).to(q_BSHD.dtype)
    result = torch_npu.npu_fusion_attention(
        q_BSHD,
        k_BSKD,
        v_BSKD,
        spec.heads,
        "BSND",
        pse=pse,
        atten_mask=atten_mask,
        scale=spec.scale,
        keep_prob=1.0 - spec.dropout_p,
        pre_tockens=_NO_LIMIT,
        next_tockens=0 if plain_causal else _NO_LIMIT,
        sparse_mode=sparse_mode,
    )
    out_BSHD, softmax_max, softmax_sum = result[0], result[1], result[2]
    if not spec.return_lse:
        return out_BSHD, None
    lse_BHS = softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())
    visible = spec.visible(0, spec.q_len, 0, spec.k_len)
    if visible is not None:
        lse_BHS = lse_BHS.masked_fill(~visible.any(-1).expand_as(lse_BHS), float("-inf"))
    return out_BSHD, lse_BHS
