"""Rotary position embeddings (RoPE): half-rotation (HF/NeoX) and interleaved (GPT-J) variants.

Shapes: B batch, S sequence, H heads, D head dim. cos/sin are [B, S, D] in fp32 with HF's
layout: frequencies repeated [f0..f_{D/2-1}, f0..f_{D/2-1}]. The interleaved variant reads the
first half of that layout and pairs dims (0,1), (2,3), ... instead of (i, i + D/2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import registry

ROPE_SCALING_KINDS = ("linear", "ntk")


@dataclass(frozen=True)
class RopeScaling:
    """Context-length scaling of RoPE."""

    kind: str = "linear"
    """"linear": positions divided by `factor` (position interpolation); "ntk": static NTK-aware
    scaling, base theta multiplied by factor ** (D / (D - 2))."""
    factor: float = 1.0
    """How many times longer than the trained context the model should reach (>= 1)."""

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"--rope-scaling-type {self.kind!r} is not supported; use one of {ROPE_SCALING_KINDS}"
            )
        if not self.factor >= 1.0:
            raise ValueError(f"--rope-scaling-factor must be >= 1, got {self.factor}")


def inverse_frequencies(
    head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """The D/2 rotation frequencies theta^(-2i/D) in fp32, with `scaling` applied."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary head_dim must be a positive even number, got {head_dim}")
    if theta <= 0:
        raise ValueError(f"--rotary-base (theta) must be > 0, got {theta}")
    base = theta
    if scaling is not None and scaling.kind == "ntk":
        base = theta * scaling.factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    return inv_freq.float()


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

    def forward(self, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos_BSD, sin_BSD) in fp32 for integer positions [B, S]."""
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(
            position_ids_BS.device
        )
        freqs_BSd = position_ids_BS[..., None].float() * inv_freq
        emb_BSD = torch.cat((freqs_BSd, freqs_BSd), dim=-1)
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
