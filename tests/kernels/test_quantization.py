"""Quantisation: round-trip bounds, per-channel vs per-tensor, KL calibration, STE vs torch."""

from __future__ import annotations

import pytest
import torch

from kernels import quantization as qz


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("axis", [None, 0])
def test_round_trip_error_is_at_most_half_a_step(symmetric, axis):
    x = torch.randn(16, 64) * 3 + (0 if symmetric else 1.5)
    qp = qz.calibrate(x, qz.QuantConfig(symmetric=symmetric, axis=axis))
    q = qz.quantize(x, qp)
    assert q.dtype == torch.int8
    assert int(q.min()) >= qp.qmin and int(q.max()) <= qp.qmax
    err = (qz.dequantize(q, qp) - x).abs()
    scale = qp.scale if axis is None else qp.scale[:, None]
    assert torch.all(err <= scale / 2 * (1 + 1e-5))


def test_asymmetric_fits_one_sided_data_better():
    x = torch.rand(1000) * 5  # all positive: symmetric wastes the negative half of the codes
    errs = {}
    for symmetric in (True, False):
        qp = qz.calibrate(x, qz.QuantConfig(symmetric=symmetric))
        errs[symmetric] = (qz.dequantize(qz.quantize(x, qp), qp) - x).pow(2).mean()
    assert errs[False] < 0.5 * errs[True]


def test_per_channel_beats_per_tensor_on_skewed_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 128, generator=g) * torch.logspace(-2, 1, 8)[:, None]
    errs = {}
    for axis in (None, 0):
        qp = qz.calibrate(w, qz.QuantConfig(axis=axis))
        errs[axis] = (qz.dequantize(qz.quantize(w, qp), qp) - w).pow(2).mean(1)
    # The small-magnitude rows are where per-tensor scales lose them.
    assert errs[0][0] < 1e-3 * errs[None][0]
    assert errs[0].mean() < errs[None].mean()


def test_kl_threshold_below_absmax_on_heavy_tailed_data():
    torch.manual_seed(1)
    x = torch.distributions.StudentT(2.0).sample((50_000,))
    x[:5] = torch.tensor([200.0, -180.0, 150.0, -300.0, 250.0])
    qp_kl = qz.calibrate(x, qz.QuantConfig(method="kl"))
    qp_max = qz.calibrate(x, qz.QuantConfig(method="absmax"))
    threshold = float(qp_kl.scale) * 127
    assert threshold < 0.2 * float(x.abs().max())
    errs = {}
    for name, qp in (("kl", qp_kl), ("absmax", qp_max)):
        errs[name] = (qz.dequantize(qz.quantize(x, qp), qp) - x).pow(2)
    bulk = x.abs() < threshold
    # Steps several times finer inside the threshold: squared error falls by well over 20x.
    assert errs["kl"][bulk].mean() < 0.05 * errs["absmax"][bulk].mean()
    assert errs["kl"].median() < errs["absmax"].median()


def test_kl_threshold_keeps_most_of_a_uniform_range():
    x = torch.rand(50_000) * 2 - 1  # no tail to clip
    assert qz.kl_threshold(x) > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quant_matches_torch_per_tensor_forward_and_ste(dtype):
    x = (torch.randn(64, 16) * 4).to(dtype)
    qp = qz.calibrate(x[:8], qz.QuantConfig(symmetric=False))  # narrow range: some x get clipped
    a = x.float().clone().requires_grad_()
    b = x.clone().requires_grad_()
    expected = torch.fake_quantize_per_tensor_affine(
        a, float(qp.scale), int(qp.zero_point), qp.qmin, qp.qmax
    )
    got = qz.fake_quantize(b, qp)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-6, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(got.float(), expected, atol=tol * 4, rtol=tol)
    gy = torch.randn(64, 16)
    expected.backward(gy)
    got.backward(gy.to(dtype))
    inside = (torch.round(x.float() / qp.scale) + qp.zero_point).clamp(-1e9, 1e9)
    inside = (inside >= qp.qmin) & (inside <= qp.qmax)
    assert 0 < inside.sum() < inside.numel()
    torch.testing.assert_close(b.grad.float(), torch.where(inside, gy.to(dtype).float(), 0.0))
    if dtype == torch.float32:
        torch.testing.assert_close(b.grad, a.grad)


def test_fake_quant_matches_torch_per_channel():
    w = torch.randn(6, 32) * torch.linspace(0.1, 3, 6)[:, None]
    qp = qz.calibrate(w, qz.QuantConfig(axis=0))
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    expected = torch.fake_quantize_per_channel_affine(
        a, qp.scale, qp.zero_point, 0, qp.qmin, qp.qmax
    )
    got = qz.fake_quantize(b, qp)
    torch.testing.assert_close(got, expected)
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(b.grad, a.grad)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="bits"):
        qz.QuantConfig(bits=16)
    with pytest.raises(ValueError, match="symmetric=True"):
        qz.QuantConfig(method="kl", symmetric=False)
    with pytest.raises(ValueError, match="axis 3"):
        qz.calibrate(torch.randn(2, 2), qz.QuantConfig(axis=3))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 32), (4, None), (8, 64)])
def test_weight_codes_equal_torchs_per_channel_quantizer(bits, group_size, symmetric):
    g = torch.Generator().manual_seed(bits + (group_size or 0))
    w = torch.randn(12, 128, generator=g) * torch.logspace(-2, 0, 12)[:, None] + 0.01
    scheme = qz.WeightScheme(bits, group_size, symmetric)
    q = qz.quantize_weight(w, scheme)
    groups = scheme.groups(128)
    rows = w.reshape(12 * groups, -1)
    zero = torch.zeros(12 * groups, dtype=torch.int64)
    if q.zero_point is not None:
        zero = q.zero_point.reshape(-1).long()
    # torch's reference quantizer (round half to even), one channel per group, same parameters
    reference = torch.quantize_per_channel(
        rows, q.scale.reshape(-1).double(), zero, axis=0, dtype=torch.qint8
    ).int_repr()
    lo = -(2 ** (bits - 1)) + (1 if symmetric else 0)
    expected = reference.clamp(lo, 2 ** (bits - 1) - 1).reshape(12, 128)
    assert torch.equal(q.codes, expected)
    step = q.scale.repeat_interleave(128 // groups, dim=1)
    assert torch.all((qz.dequantize_weight(q) - w).abs() <= step / 2 * (1 + 1e-5))


def test_int4_packs_two_codes_a_byte_and_unpacks():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)
    packed = qz.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert int(packed[0, 0]) == (0x8 | (0x9 << 4))  # -8 low, -7 high
    assert torch.equal(qz.unpack_int4(packed), codes)


def test_weight_scheme_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        qz.WeightScheme(3)
    with pytest.raises(ValueError, match="does not split into groups of 128"):
        qz.WeightScheme(4, 128).groups(96)
