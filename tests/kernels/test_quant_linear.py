"""`QuantLinear` (kernels/quant_linear.py): the layer holds codes, not a float weight, and its
forward is exactly `F.linear` on the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.quant_linear import QuantLinear
from kernels.quantization import WeightScheme, dequantize_weight, quantize_weight

SCHEMES = [
    WeightScheme(8, None, True),
    WeightScheme(8, 32, False),
    WeightScheme(4, 32, True),
    WeightScheme(4, 16, False),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_the_dequantized_linear_bit_for_bit(scheme, dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen).to(dtype)
    q = quantize_weight(weight, scheme)
    layer = QuantLinear.from_weight(q, scheme.bits, bias)
    x = torch.randn(3, 5, 64, generator=gen).to(dtype)
    want = F.linear(x, dequantize_weight(q, dtype), bias)
    assert torch.equal(layer(x), want)
    assert torch.equal(layer.weight_codes(), q.codes)
    assert not any(p.dim() == 2 for p in layer.parameters())  # no float weight held


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_holds_the_codes_bytes(scheme):
    q = quantize_weight(torch.randn(48, 64), scheme)
    layer = QuantLinear.from_weight(q, scheme.bits)
    groups = scheme.groups(64)
    code_bytes = 48 * 64 * scheme.bits // 8
    assert layer.weight_bytes() == code_bytes + 48 * groups * (4 + (not scheme.symmetric))


def test_refuses_groups_that_do_not_split_the_inputs():
    with pytest.raises(ValueError, match="64 inputs do not split into 5 groups"):
        QuantLinear(64, 8, 8, 5, True, False)
    with pytest.raises(ValueError, match="even size"):
        QuantLinear(6, 8, 4, 2, True, False)
