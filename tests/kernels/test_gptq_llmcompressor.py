"""GPTQ against llm-compressor's (0.14) `quantize_weight`, where that package is installed (it is
not a Meshline dependency: `pip install llmcompressor --no-deps compressed-tensors loguru` into
an environment that already has torch and transformers). Static groups: llm-compressor fixes
every scale from the original weights, so Meshline's static-group path is the one comparable.
Affine schemes only: compressed-tensors clamps symmetric int4 codes to [-8, 7], Meshline to
[-7, 7], so symmetric codes part at the first column that reaches -8. Checked with 0.14.0.1
and compressed-tensors 0.20.1 (a venv beside the project's, on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.gptq import GptqSettings, HessianAccumulator, gptq_quantize
from kernels.quantization import WeightScheme, dequantize_weight

llmc = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
ct = pytest.importorskip("compressed_tensors.quantization")


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, None)])
def test_gptq_equals_llm_compressor(bits: int, group: int | None, act_order: bool) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=g) * 0.05
    mix = torch.randn(256, 256, generator=g) / 16 + torch.eye(256)
    acc = HessianAccumulator(256)
    acc.add(torch.randn(2000, 256, generator=g) @ mix)
    scheme = WeightScheme(bits, group, False)
    mine = gptq_quantize(
        weight, acc.hessian, scheme, GptqSettings(act_order=act_order, static_groups=True)
    )
    assert mine.zero_point is not None
    args = ct.QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=False,
        strategy="group" if group else "channel",
        group_size=group,
        actorder=ct.ActivationOrdering.WEIGHT if act_order else None,
    )
    theirs, _, fallback = llmc.quantize_weight(
        weight.unsqueeze(0),
        acc.hessian.float().unsqueeze(0),
        mine.scale.unsqueeze(0),
        mine.zero_point.float().unsqueeze(0),
        None,
        args,
        blocksize=128,
        percdamp=0.01,
    )
    assert not bool(fallback)
    diff = (dequantize_weight(mine) - theirs[0]).abs()
    # llm-compressor works in float32, Meshline in float64: a value within float32 rounding of
    # a code boundary may round the other way there, and that row then follows another path
    # (int8 act-order: one row of 96 in this draw); every other row is the same
    parted = (diff > 1e-5).any(dim=1)
    assert int(parted.sum()) <= 1
    assert diff[~parted].max() < 1e-5
