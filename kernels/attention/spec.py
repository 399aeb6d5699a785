"""What an attention call asks for, independent of the backend that computes it.

Shapes: B batch, Sq/Sk query/key length, H query heads, K kv heads, D head dim.
Key j is visible to query i iff (not causal or j <= i + q_offset) and key j is real
(key_padding_mask) and both tokens sit in the same segment (packed documents), and, with a
sliding `window` W, j > i + q_offset - W (the query sees its last W positions). ALiBi adds
slope_h * (j - (i + q_offset)) to the scaled score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class Unsupported(Exception):
    """A backend cannot express this request; the dispatcher falls back to the next one."""


@dataclass(frozen=True)
class AttentionSpec:
    """One attention request, validated (see kernels.attention.attention for the arguments)."""

    batch: int
    q_len: int
    k_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    scale: float
    q_offset: int
    dropout_p: float
    return_lse: bool
    alibi_slopes_H: torch.Tensor | None
    key_padding_mask_BS: torch.Tensor | None
    segment_ids_BS: torch.Tensor | None
    device: torch.device
    window: int | None = None

    @property
    def simple_causal(self) -> bool:
        """Causal, top-left aligned (q_offset 0) and nothing else masked: no padding, segments,
        ALiBi or window. Kernels with a built-in causal flag (SDPA's, the fused CPU one) take
        these calls without a mask."""
        return (
            self.causal
            and self.q_offset == 0
            and self.key_padding_mask_BS is None
            and self.segment_ids_BS is None
            and self.alibi_slopes_H is None
            and self.window is None
        )

    def visible(self, q_start: int, q_end: int, k_start: int, k_end: int) -> torch.Tensor | None:
        """Bool [B or 1, 1, q_end-q_start, k_end-k_start] (True = may attend); None if all are."""
        device = self.device
        mask: torch.Tensor | None = None
        # The causal part is all True when the block's last key is visible to its first query
        # (always so for one-query decoding against a cache): no mask to build.
        if self.causal and k_end - 1 > q_start + self.q_offset:
            q_pos = torch.arange(q_start, q_end, device=device) + self.q_offset
            k_pos = torch.arange(k_start, k_end, device=device)
            mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
        if self.window is not None and k_start <= q_end - 1 + self.q_offset - self.window:
            # Some key of the block lies beyond the window of the block's last query.
            q_pos = torch.arange(q_start, q_end, device=device) + self.q_offset
            k_pos = torch.arange(k_start, k_end, device=device)
            near = (k_pos[None, :] > q_pos[:, None] - self.window)[None, None]
            mask = near if mask is None else mask & near
        if self.key_padding_mask_BS is not None:
            real = self.key_padding_mask_BS[:, None, None, k_start:k_end]
            mask = real if mask is None else mask & real
        if self.segment_ids_BS is not None:
            seg = self.segment_ids_BS
            same = seg[:, None, q_start:q_end, None] == seg[:, None, None, k_start:k_end]
            mask = same if mask is None else mask & same
        return mask

    def bias(self, q_start: int, q_end: int, k_start: int, k_end: int) -> torch.Tensor | None:
        """fp32 ALiBi bias [1, H, q_end-q_start, k_end-k_start], or None without ALiBi."""
        if self.alibi_slopes_H is None:
            return None
        device = self.device
        q_pos = torch.arange(q_start, q_end, device=device) + self.q_offset
        k_pos = torch.arange(k_start, k_end, device=device)
        distance = (k_pos[None, :] - q_pos[:, None]).float()
        slopes = self.alibi_slopes_H.to(device=device, dtype=torch.float32)
        return slopes[None, :, None, None] * distance[None, None]

    def causal_block_is_empty(self, q_end: int, k_start: int) -> bool:
        """True when every key from k_start on lies above the diagonal for queries < q_end."""
        return self.causal and k_start > q_end - 1 + self.q_offset


def build_spec(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    alibi_slopes_H: torch.Tensor | None,
    key_padding_mask_BS: torch.Tensor | None,
    segment_ids_BS: torch.Tensor | None,
    q_offset: int | None,
    dropout_p: float,
    return_lse: bool,
    window: int | None = None,
) -> AttentionSpec:
    """Check shapes and arguments; every error names the argument and the expected form."""
    _check_qkv(q_BSHD, k_BSKD, v_BSKD)
    B, Sq, H, D = q_BSHD.shape
    Sk = k_BSKD.shape[1]
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p}")
    _check_masks(key_padding_mask_BS, segment_ids_BS, B, Sq, Sk)
    if alibi_slopes_H is not None and alibi_slopes_H.shape != (H,):
        raise ValueError(
            f"attention: alibi_slopes_H must have shape [H={H}], got {tuple(alibi_slopes_H.shape)}"
        )
    if window is not None and (not causal or int(window) <= 0):
        raise ValueError(f"attention: window={window} needs causal=True and a positive size")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if not scale > 0:
        raise ValueError(f"attention: softmax_scale must be > 0, got {softmax_scale}")
    return AttentionSpec(
        batch=B,
        q_len=Sq,
        k_len=Sk,
        heads=H,
        kv_heads=k_BSKD.shape[2],
        head_dim=D,
        causal=causal,
        scale=scale,
        q_offset=Sk - Sq if q_offset is None else int(q_offset),
        dropout_p=float(dropout_p),
        return_lse=return_lse,
        alibi_slopes_H=None if alibi_slopes_H is None else alibi_slopes_H.to(q_BSHD.device),
        key_padding_mask_BS=(
            None if key_padding_mask_BS is None else key_padding_mask_BS.to(q_BSHD.device)
        ),
        segment_ids_BS=None if segment_ids_BS is None else segment_ids_BS.to(q_BSHD.device),
        device=q_BSHD.device,
        window=None if window is None else int(window),
    )


def _check_qkv(q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor) -> None:
    """q, k and v are 4-D with one batch size, head dim and dtype, and K divides H."""
    for name, t in (("q_BSHD", q_BSHD), ("k_BSKD", k_BSKD), ("v_BSKD", v_BSKD)):
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must be 4-D [B, S, heads, D], got {tuple(t.shape)}"
            )
    B, _, H, D = q_BSHD.shape
    Bk, _, K, Dk = k_BSKD.shape
    if k_BSKD.shape != v_BSKD.shape:
        raise ValueError(
            f"attention: k {tuple(k_BSKD.shape)} and v {tuple(v_BSKD.shape)} must have one shape"
        )
    if Bk != B or Dk != D:
        raise ValueError(
            f"attention: q {tuple(q_BSHD.shape)} and k {tuple(k_BSKD.shape)} must share batch "
            "size and head dim"
        )
    if K == 0 or H % K:
        raise ValueError(f"attention: {H} query heads must be a multiple of {K} kv heads (GQA/MQA)")
    if not (q_BSHD.dtype == k_BSKD.dtype == v_BSKD.dtype):
        raise ValueError(
            f"attention: q/k/v dtypes differ ({q_BSHD.dtype}, {k_BSKD.dtype}, {v_BSKD.dtype})"
        )


def _check_masks(
    key_padding_mask_BS: torch.Tensor | None,
    segment_ids_BS: torch.Tensor | None,
    B: int,
    Sq: int,
    Sk: int,
) -> None:
    """The padding mask is bool [B, Sk]; segment ids are integer [B, S] with Sq == Sk."""
    if key_padding_mask_BS is not None and (
        key_padding_mask_BS.dtype != torch.bool or key_padding_mask_BS.shape != (B, Sk)
    ):
        raise ValueError(
            f"attention: key_padding_mask_BS must be bool [B={B}, Sk={Sk}] (True = real token), "
            f"got {key_padding_mask_BS.dtype} {tuple(key_padding_mask_BS.shape)}"
        )
    if segment_ids_BS is not None:
        if Sq != Sk:
            raise ValueError(
                f"attention: segment_ids_BS needs equal query and key lengths, got {Sq} and {Sk}"
            )
        if segment_ids_BS.shape != (B, Sq) or segment_ids_BS.is_floating_point():
            raise ValueError(
                f"attention: segment_ids_BS must be an integer tensor [B={B}, S={Sq}], got "
                f"{segment_ids_BS.dtype} {tuple(segment_ids_BS.shape)}"
            )


def repeat_kv(x_BSKD: torch.Tensor, heads: int) -> torch.Tensor:
    """Expand K kv heads to H query heads: query head h reads kv head h // (H / K)."""
    kv_heads = x_BSKD.shape[2]
    if kv_heads == heads:
        return x_BSKD
    return x_BSKD.repeat_interleave(heads // kv_heads, dim=2)
