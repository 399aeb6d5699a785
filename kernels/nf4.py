"""4-bit NormalFloat (NF4), the data type of QLoRA (Dettmers et al., 2023) and of bitsandbytes'
`quant_type="nf4"`: a frozen weight stored as 4-bit indices into a 16-value table, one fp32
absmax scale per block of BLOCK consecutive values (row-major order).

The table holds quantiles of N(0, 1) normalised to [-1, 1], with an exact 0 (the paper's
asymmetric construction: 8 positive and 7 negative quantiles); the values below are the paper's
and bitsandbytes'. A value x of a block with absmax a gets the index of the table entry nearest
to x / a; it dequantizes to table[index] · a. Two indices a byte, element 2j in the low nibble
(Meshline's int4 packing). Double quantization of the absmax scales is not done: they stay fp32
(4 bytes per 64 values, 0.5 bit a weight).
"""

from __future__ import annotations

import torch
from torch import nn

NF4_TABLE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""NF4's 16 values, index order."""
BLOCK = 64
"""Values per absmax scale (bitsandbytes' default blocksize for NF4)."""


def nf4_quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed indices uint8 [numel/2], absmax fp32 [numel/block]) of `weight` (ValueError
    when its size is not whole blocks)."""
    flat = weight.detach().float().reshape(-1)
    if flat.numel() % block or block % 2:
        raise ValueError(
            f"NF4 blocks of {block} values: a weight of {flat.numel()} values is not whole blocks"
        )
    blocks = flat.reshape(-1, block)
    absmax = blocks.abs().amax(1)
    scaled = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    table = torch.tensor(NF4_TABLE)
    # nearest entry: the table is sorted, so count the midpoints below each value
    midpoints = (table[1:] + table[:-1]) / 2
    index = torch.bucketize(scaled, midpoints).to(torch.uint8).reshape(-1)
    return index[0::2] | (index[1::2] << 4), absmax


def nf4_dequantize(
    packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The weight of `shape` that NF4 `packed` indices and `absmax` scales stand for, in
    `dtype` (computed in fp32)."""
    index = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1).long()
    table = torch.tensor(NF4_TABLE, device=packed.device)
    values = table[index].reshape(absmax.numel(), -1) * absmax[:, None]
    return values.reshape(shape).to(dtype)


class NF4Weight(nn.Module):
    """A frozen weight held as NF4 (packed indices and absmax buffers)."""

    def __init__(self, weight: torch.Tensor, block: int = BLOCK) -> None:
        super().__init__()
        packed, absmax = nf4_quantize(weight, block)
        self.shape = tuple(weight.shape)
        self.block = block
        self.register_buffer("packed", packed.to(weight.device))
        self.register_buffer("absmax", absmax.to(weight.device))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the indices stand for, in `dtype`."""
        return nf4_dequantize(self.packed, self.absmax, self.shape, dtype)

    def weight_bytes(self) -> int:
        """Bytes held: indices and scales."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"shape={self.shape}, nf4, block={self.block}"
