"""Rotary position embeddings (RoPE): half-rotation (HF/NeoX) and interleaved (GPT-J) variants.

Shapes: B batch, S sequence, H heads, D head dim. cos/sin are [B, S, D] in fp32 with HF's
layout: frequencies repeated [f0..f_{D/2-1}, f0..f_{D/2-1}]. The interleaved variant reads the
first half of that layout and pairs dims (0,1), (2,3), ... instead of (i, i + D/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels import registry

ROPE_SCALING_KINDS = ("linear", "ntk", "dynamic", "llama3", "yarn")
_NEEDS_ORIGINAL = ("dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Context-length scaling of RoPE (HF's rope_type names and formulas, transformers
    modeling_rope_utils; plus Meshline's static "ntk")."""

    kind: str = "linear"
    """"linear": positions divided by `factor` (position interpolation); "ntk": static NTK-aware
    scaling, base theta multiplied by factor ** (D / (D - 2)); "dynamic": NTK scaling whose base
    grows with the longest position of the call past `original_max_position_embeddings`;
    "llama3": Llama-3.1's per-wavelength interpolation; "yarn": YaRN ramp + attention factor."""
    factor: float = 1.0
    """How many times longer than the trained context the model should reach (>= 1)."""
    original_max_position_embeddings: int | None = None
    """Pre-training context length ("dynamic", "llama3", "yarn" need it)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original/low_freq_factor are fully interpolated."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original/high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated band."""
    beta_slow: float = 1.0
    """yarn: rotations bounding the interpolated band."""
    mscale: float | None = None
    """yarn: numerator scale of the inferred attention factor (with mscale_all_dim)."""
    mscale_all_dim: float | None = None
    """yarn: denominator scale of the inferred attention factor."""
    attention_factor: float | None = None
    """yarn: explicit cos/sin scale; None infers it from factor (and mscale)."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"--rope-scaling-type {self.kind!r} is not supported; use one of {ROPE_SCALING_KINDS}"
            )
        if not self.factor >= 1.0:
            raise ValueError(f"--rope-scaling-factor must be >= 1, got {self.factor}")
        if self.kind in _NEEDS_ORIGINAL and not (
            isinstance(self.original_max_position_embeddings, int)
            and self.original_max_position_embeddings > 0
        ):
            raise ValueError(
                f"--rope-scaling-type {self.kind!r} needs original_max_position_embeddings (the "
                f"pre-training context length), got {self.original_max_position_embeddings!r}"
            )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    @classmethod
    def from_dict(cls, data: dict) -> RopeScaling:
        """From a ModelConfig.rope_scaling dict ({"type": ..., "factor": ..., HF's other keys});
        unknown keys raise TypeError naming them."""
        fields = {k: v for k, v in data.items() if k != "type"}
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__) - {"kind"})
        if unknown:
            raise TypeError(f"unknown rope scaling key(s) {unknown}")
        return cls(kind=data.get("type", "linear"), **{k: v for k, v in fields.items()})

    def cos_sin_scale(self) -> float:
        """Factor applied to cos and sin (YaRN's attention factor; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(
                self.factor, self.mscale_all_dim
            )
        return get_mscale(self.factor)


def inverse_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """The D/2 rotation frequencies theta^(-2i/D) in fp32, with `scaling` applied.

    `seq_len` (longest position + 1 of the call) matters only to "dynamic" scaling.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary head_dim must be a positive even number, got {head_dim}")
    if theta <= 0:
        raise ValueError(f"--rotary-base (theta) must be > 0, got {theta}")
    base = theta
    kind = None if scaling is None else scaling.kind
    if scaling is not None and kind == "ntk":
        base = theta * scaling.factor ** (head_dim / (head_dim - 2))
    if scaling is not None and kind == "dynamic":
        original = scaling.original_max_position_embeddings or 1
        length = max(seq_len or original, original)
        base = theta * ((scaling.factor * length / original) - (scaling.factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is not None and kind == "linear":
        inv_freq = inv_freq / scaling.factor
    if scaling is not None and kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    if scaling is not None and kind == "yarn":
        inv_freq = _yarn(inv_freq, head_dim, theta, scaling)
    return inv_freq.float()


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3.1: keep high frequencies, divide low ones by factor, blend in between."""
    original = float(s.original_max_position_embeddings or 1)
    low_wavelen = original / s.low_freq_factor
    high_wavelen = original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between."""
    original = float(s.original_max_position_embeddings or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given position ids (no buffers: safe to build on the meta device)."""

    def __init__(
        self, head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        inverse_frequencies(head_dim, theta, scaling)  # validate now, not at first forward
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.scale = 1.0 if scaling is None else scaling.cos_sin_scale()

    def forward(self, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos_BSD, sin_BSD) in fp32 for integer positions [B, S]."""
        seq_len = None
        if self.scaling is not None and self.scaling.kind == "dynamic":
            # HF recomputes the base from the longest position of the call (a host read, only
            # for this scaling).
            seq_len = int(position_ids_BS.max()) + 1
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling, seq_len).to(
            position_ids_BS.device
        )
        freqs_BSd = position_ids_BS[..., None].float() * inv_freq
        emb_BSD = torch.cat((freqs_BSd, freqs_BSd), dim=-1)
        if self.scale != 1.0:
            return emb_BSD.cos() * self.scale, emb_BSD.sin() * self.scale
        return emb_BSD.cos(), emb_BSD.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary_reference(
    x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x·cos + rotate(x)·sin computed in fp32, returned in x's dtype."""
    cos_BS1D = cos_BSD.float().unsqueeze(2)
    sin_BS1D = sin_BSD.float().unsqueeze(2)
    x = x_BSHD.float()
    if interleaved:
        half = x.shape[-1] // 2
        cos_BS1D = cos_BS1D[..., :half].repeat_interleave(2, dim=-1)
        sin_BS1D = sin_BS1D[..., :half].repeat_interleave(2, dim=-1)
        out = x * cos_BS1D + _rotate_interleaved(x) * sin_BS1D
    else:
        out = x * cos_BS1D + _rotate_half(x) * sin_BS1D
    return out.to(x_BSHD.dtype)


APPLY_ROTARY = registry.define("apply_rotary", apply_rotary_reference)
APPLY_ROTARY.register("npu", ("npu",), "kernels.npu.rotary:apply_rotary")
APPLY_ROTARY.register("compiled", ("cuda",), "kernels.cuda.compiled:apply_rotary")


def rotary_qkv_reference(
    qkv_BSXD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of a fused [B, S, H + 2K, D] projection rotated (rotate-half) in one
    apply_rotary, and v as a view of the projection."""
    qk_BSXD, v_BSKD = qkv_BSXD.split([heads + kv_heads, kv_heads], dim=2)
    qk_BSXD = apply_rotary(qk_BSXD, cos_BSD, sin_BSD)
    q_BSHD, k_BSKD = qk_BSXD.split([heads, kv_heads], dim=2)
    return q_BSHD, k_BSKD, v_BSKD


ROTARY_QKV = registry.define("rotary_qkv", rotary_qkv_reference)
# The fused CPU kernel (C) while training: rotation, v's copy and the one q|k|v gradient in a
# pass each; the reference elsewhere (bit-identical results; kernels/cpu/fused.py).
ROTARY_QKV.register("fused", ("cpu",), "kernels.cpu.fused:rotary_qkv")


def rotary_qkv(
    qkv_BSXD: torch.Tensor,
    cos_BSD: torch.Tensor,
    sin_BSD: torch.Tensor,
    heads: int,
    kv_heads: int,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, S, H, D], k [B, S, K, D], v [B, S, K, D]) of a fused q|k|v projection
    [B, S, H + 2K, D], q and k rotated by cos/sin [B or 1, S, D] (rotate-half)."""
    if qkv_BSXD.dim() != 4 or qkv_BSXD.shape[2] != heads + 2 * kv_heads:
        raise ValueError(
            f"rotary_qkv: qkv must be [B, S, heads + 2 * kv_heads = {heads + 2 * kv_heads}, D], "
            f"got shape {tuple(qkv_BSXD.shape)}"
        )
    return ROTARY_QKV(qkv_BSXD, cos_BSD, sin_BSD, heads, kv_heads, backend=backend)


def apply_rotary(
    x_BSHD: torch.Tensor,
    cos_BSD: torch.Tensor,
    sin_BSD: torch.Tensor,
    interleaved: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotate q or k [B, S, H, D] by positions' cos/sin [B or 1, S, D]; result in x's dtype."""
    if x_BSHD.dim() != 4:
        raise ValueError(f"apply_rotary: x must be [B, S, H, D], got shape {tuple(x_BSHD.shape)}")
    if cos_BSD.shape != sin_BSD.shape or cos_BSD.shape[-1] != x_BSHD.shape[-1]:
        raise ValueError(
            f"apply_rotary: cos {tuple(cos_BSD.shape)} and sin {tuple(sin_BSD.shape)} must both be "
            f"[B, S, D] with D = x's head dim {x_BSHD.shape[-1]}"
        )
    if cos_BSD.shape[1] != x_BSHD.shape[1]:
        raise ValueError(
            f"apply_rotary: cos/sin cover {cos_BSD.shape[1]} positions but x has "
            f"{x_BSHD.shape[1]}; compute them from x's position ids"
        )
    return APPLY_ROTARY(x_BSHD, cos_BSD, sin_BSD, interleaved, backend=backend)
