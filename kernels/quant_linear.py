"""Weight-only quantized linear layers for serving: int8 (per channel or group-wise) and int4
(group-wise, two codes a byte), symmetric or affine, as `kernels.quantization.quantize_weight`
makes them and quantized checkpoints store them (checkpoints/quantized_format.py).

Shapes: x [..., I] (I input features), codes [O, I] (int8) or packed [O, I/2] (uint8), scale
[O, G] float32, zero [O, G] int8 or None (G groups of I/G inputs), out [..., O].

The layer holds the codes, never a float copy of the weight: int8 weights take a quarter of
fp32's bytes (half of bf16's), int4 an eighth (a quarter), plus 4 bytes of scale a group. The
CPU decode step in C reads them directly (engine/cpu_decode_quant.h: dequantized in registers,
fp32 sums), which is where the served tokens/s comes from. Every other call (prefills, scoring,
the lean step, CUDA) runs `forward`: the weight dequantized ((codes − zero) · scale, in the
input's dtype) for that call and dropped after it, so those calls give exactly what the model
dequantized at load would give (tested bit for bit), with one layer's float weight alive at a
time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.quantization import QuantizedWeight, dequantize_weight, pack_int4, unpack_int4


class QuantLinear(nn.Module):
    """y = x Ŵ^T + b with Ŵ = (codes − zero) · scale per group of inputs, stored quantized."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        groups: int,
        symmetric: bool,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"QuantLinear: bits must be 4 or 8, got {bits}")
        if groups < 1 or in_features % groups or (bits == 4 and (in_features // groups) % 2):
            raise ValueError(
                f"QuantLinear: {in_features} inputs do not split into {groups} groups"
                + (" of an even size (int4 packs two codes a byte)" if bits == 4 else "")
            )
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.groups = groups
        self.symmetric = symmetric
        if bits == 8:
            self.register_buffer(
                "codes", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
            )
        else:
            self.register_buffer(
                "packed",
                torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device),
            )
        self.register_buffer(
            "scale", torch.empty(out_features, groups, dtype=torch.float32, device=device)
        )
        zero = None if symmetric else torch.empty(out_features, groups, dtype=torch.int8)
        self.register_buffer("zero", None if zero is None else zero.to(device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )

    @classmethod
    def from_weight(
        cls, q: QuantizedWeight, bits: int, bias: torch.Tensor | None = None
    ) -> QuantLinear:
        """The layer holding `q`'s codes (int4 packed), scales and zero points, and `bias`."""
        out, columns = q.codes.shape
        layer = cls(
            columns,
            out,
            bits,
            q.scale.shape[1],
            q.zero_point is None,
            bias is not None,
            device=q.codes.device,
            dtype=bias.dtype if bias is not None else torch.float32,
        )
        with torch.no_grad():
            if bits == 8:
                layer.codes.copy_(q.codes)
            else:
                layer.packed.copy_(pack_int4(q.codes))
            layer.scale.copy_(q.scale)
            if q.zero_point is not None:
                layer.zero.copy_(q.zero_point)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    @property
    def group_size(self) -> int:
        """Inputs sharing one scale (and zero point)."""
        return self.in_features // self.groups

    def weight_codes(self) -> torch.Tensor:
        """int8 codes [O, I] (int4 ones unpacked)."""
        return self.codes if self.bits == 8 else unpack_int4(self.packed)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [O, I] the codes stand for, in `dtype`."""
        return dequantize_weight(QuantizedWeight(self.weight_codes(), self.scale, self.zero), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x Ŵ^T + b, Ŵ dequantized for this call in x's dtype."""
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def weight_bytes(self) -> int:
        """Bytes the layer holds for its weight: codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "affine"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int{self.bits}, group_size={self.group_size}, {kind}, bias={self.bias is not None}"
        )
