"""QLoRA: LoRA adapters over a frozen base held below 16 bits (`--base-quant nf4|int4|int8`).

Shapes: N tokens (any leading dims), I in features, O out features.

`quantize_lora_base(model, kind)` turns every `LoraLinear` (models/lora.py) into a
`QLoraLinear`: the same adapter modules (the very `lora_A` / `lora_B` parameters, so an optimizer
built on them keeps working) and bias, with the frozen base weight replaced by its quantized form
— NF4 blocks of 64 (kernels/nf4.py, QLoRA's data type), or Meshline's weight-only round to
nearest (kernels/quant_linear.py: int4 symmetric groups of 64, int8 per output channel). The
float base weight is dropped; each forward dequantizes it for that call (no gradient flows into
it) and computes peft's `W x + b + B(A(dropout(x))) · alpha / r` with it, so the adapters train
exactly as LoRA on the dequantized base would (tested against peft on that base).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.nf4 import NF4Weight
from kernels.quant_linear import QuantLinear
from kernels.quantization import WeightScheme, quantize_weight
from models.lora import LoraLinear

BASE_QUANT = ("nf4", "int4", "int8")
"""--base-quant choices."""
INT4_GROUP = 64
"""Inputs per scale of an int4 base (NF4's block size)."""


class QLoraLinear(LoraLinear):
    """A LoRA layer whose frozen base weight is held quantized (`base`)."""

    def __init__(self, lora: LoraLinear, base: NF4Weight | QuantLinear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = lora.in_features, lora.out_features
        self.bias = lora.bias
        self.lora_A, self.lora_B, self.lora_dropout = lora.lora_A, lora.lora_B, lora.lora_dropout
        self.r, self.scaling = lora.r, lora.scaling
        self.base = base
        self.compute_dtype = lora.lora_A.weight.dtype
        """Dtype the base weight is dequantized to (the adapters')."""

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The base weight the codes stand for (a new tensor each call, no gradient)."""
        return self.base.dequantized(self.compute_dtype)

    def forward(self, x_NI: torch.Tensor) -> torch.Tensor:
        """W x + b + B(A(dropout(x))) · scaling, W dequantized for this call in x's dtype."""
        out_NO = F.linear(x_NI, self.base.dequantized(x_NI.dtype), self.bias)
        x_NI = x_NI.to(self.lora_A.weight.dtype)
        return out_NO + self.lora_B(self.lora_A(self.lora_dropout(x_NI))) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}"


def quantized_base(weight: torch.Tensor, kind: str) -> NF4Weight | QuantLinear:
    """`weight` [O, I] held as `kind` (ValueError naming --base-quant when it cannot be)."""
    if kind == "nf4":
        return NF4Weight(weight)
    if kind not in BASE_QUANT:
        raise ValueError(f"--base-quant {kind!r}: choose one of {list(BASE_QUANT)}")
    scheme = WeightScheme(8, None, True) if kind == "int8" else WeightScheme(4, INT4_GROUP, True)
    return QuantLinear.from_weight(quantize_weight(weight, scheme), scheme.bits)


def quantize_lora_base(model: nn.Module, kind: str) -> tuple[int, int]:
    """Hold every LoRA layer's frozen base weight of `model` as `kind`, in place; returns (bytes
    of those float weights, bytes of their quantized form). ValueError naming --base-quant
    where a weight does not split into the type's blocks, or the model has no LoRA layer."""
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is LoraLinear  # not already quantized
    ]
    if not layers:
        raise ValueError(
            f"--base-quant {kind}: the model has no LoRA layer to quantize the base of; it needs "
            "--lora-target-modules (QLoRA trains LoRA adapters over the quantized base)"
        )
    before = after = 0
    for name, lora in layers:
        weight = lora.weight.detach()
        try:
            base = quantized_base(weight, kind)
        except ValueError as exc:
            raise ValueError(f"--base-quant {kind}: {name}.weight: {exc}") from exc
        before += weight.numel() * weight.element_size()
        after += base.weight_bytes()
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, leaf, QLoraLinear(lora, base))
    return before, after
