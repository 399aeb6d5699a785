"""torch's scaled_dot_product_attention, plus the CPU flash kernel when the lse is wanted.

Shapes: B batch, S sequence, H heads, K kv heads, D head dim; SDPA works in [B, H, S, D].
SDPA's own causal flag is top-left aligned, so it is used only when q_offset is 0 and nothing
else is masked; every other mask is passed explicitly. Rows that see no key are unmasked for the
kernel (whose softmax would give NaN) and zeroed afterwards, so their gradients are zero too.

For `return_lse` on CPU, `aten._scaled_dot_product_flash_attention_for_cpu` returns the
log-sum-exp but declares it non-differentiable. `_FlashCpuWithLse` restores that gradient with
the kernel's own backward: d lse_i / d s_ij = p_ij, which is what the backward computes when
the row term D_i = dO_i · O_i is lowered by the lse gradient g_i. Appending a column of ones to
O, a column -g to dO and a column of zeros to V (and to q, k) does exactly that without touching
dP = dO · V or the scores.

On CPU, attention that will be differentiated in bf16 or fp16 runs in fp32 and is cast back
(`_differentiated_in_low_precision`; both paths, so context-parallel blocks with their lse
compute as the plain path does): torch's CPU flash backward is 2.5x slower in bf16 than in
fp32 (one hidden-256 layer, micro-batch 4, seq 256: 10.6 vs 4.3-4.6 ms), more than the casts cost,
and it made `meshline train --bf16` slower than fp32 on a CPU with bf16 matrix units. Without
gradients the bf16 kernel is the faster one (1.4 vs 2.1 ms) and stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.spec import AttentionSpec, Unsupported, repeat_kv


def _dense_mask(spec: AttentionSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(visible mask with empty rows opened up, bool [.., Sq] of rows that see a key)."""
    visible = spec.visible(0, spec.q_len, 0, spec.k_len)
    if visible is None:
        return None, None
    any_visible = visible.any(-1)
    if bool(any_visible.all()):
        return visible, None
    return visible | ~any_visible[..., None], any_visible


def attention_sdpa(
    q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA forward/backward; with return_lse, the CPU flash kernel (no dropout)."""
    dtype = q_BSHD.dtype
    upcast = _differentiated_in_low_precision(q_BSHD, k_BSKD, v_BSKD)
    if upcast:
        q_BSHD, k_BSKD, v_BSKD = q_BSHD.float(), k_BSKD.float(), v_BSKD.float()
    q_BHSD = q_BSHD.transpose(1, 2)
    simple_causal = spec.simple_causal
    if simple_causal and not spec.return_lse:
        visible, any_visible = None, None
    else:
        visible, any_visible = _dense_mask(spec)
    bias = spec.bias(0, spec.q_len, 0, spec.k_len)
    attn_mask: torch.Tensor | None = visible
    if bias is not None or (spec.return_lse and visible is not None):
        float_mask = torch.zeros((), device=q_BSHD.device) if bias is None else bias
        if visible is not None:
            float_mask = float_mask.masked_fill(~visible, float("-inf"))
        attn_mask = float_mask.to(q_BSHD.dtype)
    if spec.return_lse:
        out_BHSD, lse_BHS = _lse_path(q_BHSD, k_BSKD, v_BSKD, spec, attn_mask)
    elif (
        spec.q_len == 1
        and not simple_causal
        and spec.dropout_p == 0
        and folds_query_groups(q_BHSD, k_BSKD.shape[2], attn_mask)
    ):
        out_BHSD = grouped_single_query(
            q_BHSD, k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2), attn_mask, spec.scale
        )
        lse_BHS = None
    else:
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD,
            k_BSKD.transpose(1, 2),
            v_BSKD.transpose(1, 2),
            attn_mask=attn_mask,
            dropout_p=spec.dropout_p,
            is_causal=simple_causal,
            scale=spec.scale,
            enable_gqa=spec.heads != spec.kv_heads,
        )
        lse_BHS = None
    if upcast:
        out_BHSD = out_BHSD.to(dtype)
    if any_visible is not None:
        out_BHSD = out_BHSD * any_visible[..., None].to(out_BHSD.dtype)
        if lse_BHS is not None:
            lse_BHS = lse_BHS.masked_fill(~any_visible.expand_as(lse_BHS), float("-inf"))
    return out_BHSD.transpose(1, 2), lse_BHS


def _differentiated_in_low_precision(*tensors: torch.Tensor) -> bool:
    """CPU bf16/fp16 attention whose backward will run (see the module docstring)."""
    q = tensors[0]
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in tensors)
    )


def folds_query_groups(q_BHSD: torch.Tensor, kv_heads: int, attn_mask: torch.Tensor | None) -> bool:
    """Whether `grouped_single_query` applies: one query per row on CPU, grouped kv heads, and
    a mask (if any) shared by every head."""
    return (
        q_BHSD.device.type == "cpu"
        and q_BHSD.shape[2] == 1
        and q_BHSD.shape[1] != kv_heads
        and (attn_mask is None or attn_mask.dim() < 4 or attn_mask.shape[1] == 1)
    )


def grouped_single_query(
    q_BH1D: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """SDPA of one query per row under grouped-query attention, as G = H/K queries per kv head.

    The G query heads that share a kv head see the same keys under the same mask, and with one
    query per row none of them is causal to another, so they can be one kv head's "sequence" of
    G queries: plain SDPA over [B, K, G, D] against [B, K, S, D]. On CPU this is ~2.3x faster
    than `enable_gqa`, which repeats every cached key and value H/K times (8/4 heads, 80 keys,
    8 rows: 47 vs 108 µs). Out [B, H, 1, D]; `attn_mask` broadcasts over heads ([B|1, 1, 1, S]).
    """
    b, h, _, d = q_BH1D.shape
    k = k_BKSD.shape[1]
    q_BKGD = q_BH1D.reshape(b, k, h // k, d)
    out_BKGD = F.scaled_dot_product_attention(
        q_BKGD, k_BKSD, v_BKSD, attn_mask=attn_mask, dropout_p=0.0, scale=scale
    )
    return out_BKGD.reshape(b, h, 1, d)


def _lse_path(
    q_BHSD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    spec: AttentionSpec,
    attn_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_BHSD.device.type != "cpu":
        raise Unsupported("the lse-returning SDPA path uses the CPU flash kernel")
    if spec.dropout_p > 0:
        raise Unsupported("the CPU flash kernel with lse has no dropout")
    k_BHSD = repeat_kv(k_BSKD, spec.heads).transpose(1, 2)
    v_BHSD = repeat_kv(v_BSKD, spec.heads).transpose(1, 2)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(spec.batch, spec.heads, spec.q_len, spec.k_len)
    out, lse = _FlashCpuWithLse.apply(q_BHSD, k_BHSD, v_BHSD, attn_mask, spec.scale)
    return out, lse.float()


class _FlashCpuWithLse(torch.autograd.Function):
    """CPU flash attention returning (out, lse), both differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=attn_mask, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is not None:
            ones = torch.ones_like(out[..., :1])
            out = torch.cat([out, ones], dim=-1)
            grad_out = torch.cat([grad_out, -grad_lse[..., None].to(grad_out.dtype)], dim=-1)
            # The kernel wants one head size for q, k and v: zero columns leave q·k unchanged.
            q, k, v = (torch.cat([t, torch.zeros_like(t[..., :1])], dim=-1) for t in (q, k, v))
        grad_q, grad_k, grad_v = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.contiguous(),
                q,
                k,
                v.contiguous(),
                out.contiguous(),
                lse,
                0.0,
                False,
                attn_mask=attn_mask,
                scale=ctx.scale,
            )
        )
        head_dim = ctx.saved_tensors[0].shape[-1]
        return grad_q[..., :head_dim], grad_k[..., :head_dim], grad_v[..., :head_dim], None, None
