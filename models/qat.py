"""Quantization-aware training: the decoder's linear layers compute with their weights
fake-quantized (quantized and dequantized in the forward) as serving will hold them, with the
straight-through estimator in the backward, so the trained weights suit the rounding.

`apply_qat(model, scheme)` turns every linear a quantized checkpoint stores quantized (a linear
inside a decoder layer, as `checkpoints.quantized_format.quantized` selects) into a `QATLinear`:
the same
`weight` and `bias` parameters under the same names (checkpoints, optimizers and exports see an
ordinary model), whose forward uses `fake_quantize_weight(weight)`: round to nearest with the
scheme's scales computed from the current weight (absmax per output channel or per group; the
affine range for affine schemes), exactly the codes `kernels.quantization.quantize_weight` gives
the trained weight, so a model trained this way and then quantized computes what it computed in
training. The gradient passes straight through where a weight is inside the range (everywhere,
for absmax scales). Learned step sizes (LSQ/LSQ+) are not implemented.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.quantization import QuantConfig, WeightScheme, calibrate, fake_quantize


def fake_quantize_weight(weight: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """`weight` [O, I] quantized and dequantized under `scheme` in its dtype, with the
    straight-through gradient; the values equal `dequantize_weight(quantize_weight(weight))`."""
    out, columns = weight.shape
    groups = scheme.groups(columns)
    rows = weight.reshape(out * groups, columns // groups)
    qp = calibrate(rows, QuantConfig(bits=scheme.bits, symmetric=scheme.symmetric, axis=0))
    return fake_quantize(rows, qp).reshape(out, columns)


class QATLinear(nn.Linear):
    """An nn.Linear whose forward uses its weight fake-quantized under `scheme`."""

    def __init__(self, linear: nn.Linear, scheme: WeightScheme) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.scheme = scheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x Q(W)^T + b, Q the scheme's quantize-dequantize (straight-through gradient)."""
        return F.linear(x, fake_quantize_weight(self.weight, self.scheme), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qat=int{self.scheme.bits}"


def apply_qat(model: nn.Module, scheme: WeightScheme) -> list[str]:
    """Fake-quantize, in place, the decoder linears of `model` under `scheme`; returns their
    module names. ValueError naming the layer whose inputs do not split into the groups."""
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name.startswith("layers.")
    ]
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        linear = getattr(owner, leaf)
        try:
            scheme.groups(linear.in_features)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        setattr(owner, leaf, QATLinear(linear, scheme))
    return names
