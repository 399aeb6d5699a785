"""A weight-only quantized token embedding for serving: the table held as int8 codes (or int4,
two a byte) with fp32 scales per group of a row (and int8 zero points when affine), the same
layout as `QuantLinear`'s weight, so a tied output head shares the very same tensors
(`tied_linear`).

Shapes: ids [...], codes [V, E] (int8) or packed [V, E/2] (uint8), scale [V, G] float32, zero
[V, G] int8 or None, out [..., E] in `dtype`.

A lookup dequantizes only the rows it reads ((codes − zero) · scale, in fp32, then rounded to
`dtype`), so it gives exactly the rows of the table dequantized at load (tested bit for bit);
the CPU decode step in C does the same for its one row a token (engine/cpu_decode_quant.h).
For SmolLM2-135M the tied 49152 × 576 table is 108 MiB in fp32 and 27 MiB as int8 codes — and as
the output head it is the largest single matrix a decode step reads.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.quant_linear import QuantLinear
from kernels.quantization import QuantizedWeight, dequantize_weight, unpack_int4

_PARTS = ("codes", "packed", "scale", "zero")


class QuantEmbedding(nn.Module):
    """Rows of Ŵ = (codes − zero) · scale per group, stored quantized; no float copy."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bits: int,
        groups: int,
        symmetric: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        # the same buffers, checks and shapes as a QuantLinear [V, E] (a tied head shares them)
        layout = QuantLinear(embedding_dim, num_embeddings, bits, groups, symmetric, False, device)
        for name, tensor in layout.named_buffers():
            self.register_buffer(name, tensor)
        if layout.zero is None:
            self.register_buffer("zero", None)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.bits = bits
        self.groups = groups
        self.symmetric = symmetric
        self.dtype = dtype
        """The dtype of the rows a lookup returns (the model's kept tensors')."""

    @classmethod
    def from_weight(
        cls, q: QuantizedWeight, bits: int, dtype: torch.dtype = torch.float32
    ) -> QuantEmbedding:
        """The embedding holding `q`'s codes (int4 packed), scales and zero points."""
        linear = QuantLinear.from_weight(q, bits)
        out = cls(linear.out_features, linear.in_features, bits, linear.groups, linear.symmetric,
                  dtype, device=q.codes.device)  # fmt: skip
        out.share(linear)
        return out

    @property
    def group_size(self) -> int:
        """Inputs sharing one scale (and zero point)."""
        return self.embedding_dim // self.groups

    def share(self, other: nn.Module) -> None:
        """Point this table's buffers at `other`'s (a QuantLinear or QuantEmbedding of the same
        layout), with no copy."""
        for name in _PARTS:
            if name in self._buffers:
                self._buffers[name] = other._buffers[name]

    def tied_linear(self) -> QuantLinear:
        """A QuantLinear [V, E] on the same tensors (no copy): the tied output head."""
        head = QuantLinear(self.embedding_dim, self.num_embeddings, self.bits, self.groups,
                           self.symmetric, False, device="meta")  # fmt: skip
        for name in _PARTS:
            if name in head._buffers:
                head._buffers[name] = self._buffers[name]
        return head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids`, dequantized in fp32 and rounded to `dtype`."""
        flat = ids.reshape(-1)
        codes = self.codes[flat] if self.bits == 8 else unpack_int4(self.packed[flat])
        zero = None if self.zero is None else self.zero[flat]
        rows = dequantize_weight(QuantizedWeight(codes, self.scale[flat], zero), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole float table [V, E] the codes stand for (in `dtype`, default the rows')."""
        codes = self.codes if self.bits == 8 else unpack_int4(self.packed)
        q = QuantizedWeight(codes, self.scale, self.zero)
        return dequantize_weight(q, dtype or self.dtype)

    def weight_bytes(self) -> int:
        """Bytes the table holds: codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "affine"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits}, "
            f"group_size={self.group_size}, {kind}, dtype={self.dtype}"
        )
