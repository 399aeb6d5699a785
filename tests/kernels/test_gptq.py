"""GPTQ (kernels/gptq.py) against a column-by-column textbook form of the published algorithm,
and its purpose: a lower layer-output error than round to nearest on held-out inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.gptq import GptqSettings, HessianAccumulator, gptq_quantize, prepare_hessian
from kernels.quantization import (
    QuantConfig,
    WeightScheme,
    calibrate,
    dequantize_weight,
    quantize,
    quantize_weight,
)


def textbook_gptq(
    weight: torch.Tensor, hessian: torch.Tensor, scheme: WeightScheme, act_order: bool = False
) -> torch.Tensor:
    """The dequantized weight of GPTQ done one column at a time with the explicit inverse
    Hessian (the OBS update and Gaussian elimination of the rounded column: no Cholesky, no
    blocks), groups' parameters from the updated weights at their first column (static ones,
    from the original weights, under act-order)."""
    w, h = prepare_hessian(hessian, weight, 0.01)
    columns = w.shape[1]
    group = columns if scheme.group_size is None else scheme.group_size
    config = QuantConfig(bits=scheme.bits, symmetric=scheme.symmetric, axis=0)
    hinv = torch.linalg.inv(h)
    order = list(range(columns))
    if act_order:
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True).tolist()
    static = act_order or scheme.group_size is None
    params = {
        g: calibrate(w[:, g * group : (g + 1) * group], config) for g in range(columns // group)
    }
    params = params if static else {}
    result = torch.zeros_like(w)
    left = list(order)
    for j in order:
        g = j // group
        if g not in params:
            params[g] = calibrate(w[:, g * group : (g + 1) * group], config)
        qp = params[g]
        codes = quantize(w[:, j : j + 1], qp).squeeze(1).double()
        q = (codes - qp.zero_point.double()) * qp.scale.double()
        result[:, j] = q
        left.remove(j)
        err = (w[:, j] - q) / hinv[j, j]
        w[:, left] -= err.unsqueeze(1) * hinv[j, left].unsqueeze(0)
        w[:, j] = q
        hinv = hinv - hinv[:, j : j + 1] @ hinv[j : j + 1, :] / hinv[j, j]
    return result


def _inputs(n: int, columns: int, seed: int) -> torch.Tensor:
    """Correlated inputs with a few large channels (what makes GPTQ matter), drawn with `seed`."""
    mixing = torch.Generator().manual_seed(0)  # one distribution, samples drawn by `seed`
    mix = torch.randn(columns, columns, generator=mixing) / columns**0.5 + torch.eye(columns)
    x = torch.randn(n, columns, generator=torch.Generator().manual_seed(seed)) @ mix
    x[:, :3] *= 6.0
    return x


SCHEMES = [
    WeightScheme(4, 32, True),
    WeightScheme(4, 16, False),
    WeightScheme(8, None, True),
    WeightScheme(4, None, False),
]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.bits}-g{s.group_size}-{s.symmetric}")
def test_blocked_gptq_equals_column_by_column(scheme: WeightScheme, act_order: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(24, 96)
    acc = HessianAccumulator(96)
    x = _inputs(400, 96, 1)
    acc.add(x[:150])
    acc.add(x[150:])
    torch.testing.assert_close(
        acc.hessian, 2 * x.double().T @ x.double() / 400, rtol=1e-5, atol=1e-4
    )
    # blocks of 32 columns (several blocks, lazy updates between them) and of one group
    for block in (32, 8):
        q = gptq_quantize(
            weight, acc.hessian, scheme, GptqSettings(block_size=block, act_order=act_order)
        )
        got = dequantize_weight(q).double()
        want = textbook_gptq(weight, acc.hessian, scheme, act_order)
        assert (got - want).abs().max() < 1e-5
    # the layout quantize_weight gives: codes in range, scales [O, groups], int8 zero points
    rtn = quantize_weight(weight, scheme)
    assert q.codes.dtype == torch.int8 and q.scale.shape == rtn.scale.shape
    assert (q.zero_point is None) == (rtn.zero_point is None)
    if q.zero_point is not None:
        assert q.zero_point.dtype == torch.int8


def test_diagonal_hessian_is_round_to_nearest() -> None:
    """With uncorrelated inputs no error moves: GPTQ gives RTN's codes exactly."""
    torch.manual_seed(2)
    weight = torch.randn(16, 64)
    hessian = torch.diag(torch.rand(64) + 0.5).double()
    for scheme in SCHEMES:
        q, rtn = gptq_quantize(weight, hessian, scheme), quantize_weight(weight, scheme)
        assert torch.equal(q.codes, rtn.codes)
        torch.testing.assert_close(q.scale, rtn.scale, rtol=0, atol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_below_rtn_on_held_out_inputs(act_order: bool) -> None:
    torch.manual_seed(3)
    weight = torch.randn(64, 128) * 0.05
    calibration, held_out = _inputs(1024, 128, 4), _inputs(512, 128, 5)
    acc = HessianAccumulator(128)
    acc.add(calibration)
    scheme = WeightScheme(4, 32, False)
    gptq = dequantize_weight(
        gptq_quantize(weight, acc.hessian, scheme, GptqSettings(act_order=act_order))
    )
    rtn = dequantize_weight(quantize_weight(weight, scheme))
    exact = held_out @ weight.T
    gptq_err = (held_out @ gptq.T - exact).norm()
    rtn_err = (held_out @ rtn.T - exact).norm()
    assert gptq_err < 0.8 * rtn_err, (gptq_err, rtn_err)


def test_dead_inputs_and_refusals() -> None:
    weight = torch.randn(8, 32)
    hessian = torch.zeros(32, 32, dtype=torch.float64)
    hessian[:16, :16] = torch.eye(16)
    q = gptq_quantize(weight, hessian, WeightScheme(4, 16, True))
    assert torch.all(dequantize_weight(q)[:, 16:] == 0)  # inputs that never fire are dropped
    with pytest.raises(ValueError, match="do not match"):
        gptq_quantize(weight, torch.eye(16), WeightScheme(4, 16, True))
    with pytest.raises(ValueError, match="dampening"):
        GptqSettings(percdamp=0.0)
