"""Integer quantisation: symmetric / asymmetric, per-tensor / per-channel, absmax or
KL-calibrated thresholds, and fake quantisation with a straight-through estimator (QAT).

Affine mapping: q = clamp(round(x / scale) + zero_point, qmin, qmax), x̂ = (q - zero_point)·scale,
round half to even (as torch's quantized ops). Symmetric uses [-(2^(b-1) - 1), 2^(b-1) - 1] with
zero_point 0; asymmetric uses [-2^(b-1), 2^(b-1) - 1] over [min(x, 0), max(x, 0)].
"KL" calibration (TensorRT's entropy calibration) picks the clipping threshold T whose
quantised histogram of |x| is closest, in KL divergence, to the histogram clipped at T:
heavy-tailed data gets T below its absmax, trading rare clipped outliers for finer steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

METHODS = ("absmax", "kl")


@dataclass(frozen=True)
class QuantConfig:
    """How to choose quantisation parameters."""

    bits: int = 8
    """Integer width (2..8; stored in int8)."""
    symmetric: bool = True
    """Zero point 0 and a range symmetric around it; False fits [min, max] with a zero point."""
    axis: int | None = None
    """Per-channel along this dim (e.g. 0 = output channels of a Linear weight); None = per-tensor."""
    method: str = "absmax"
    """Threshold: "absmax" (the largest |x|) or "kl" (entropy calibration; symmetric only)."""
    kl_bins: int = 2048
    """Histogram bins of |x| searched by KL calibration."""

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"quantisation bits must be in [2, 8], got {self.bits}")
        if self.method not in METHODS:
            raise ValueError(f"quantisation method {self.method!r}; use one of {METHODS}")
        if self.method == "kl" and not self.symmetric:
            raise ValueError("KL calibration searches a symmetric threshold: set symmetric=True")
        if self.kl_bins < 2 ** (self.bits - 1):
            raise ValueError(f"kl_bins must be >= {2 ** (self.bits - 1)}, got {self.kl_bins}")

    @property
    def qmin(self) -> int:
        """Smallest integer code."""
        return -(2 ** (self.bits - 1)) + (1 if self.symmetric else 0)

    @property
    def qmax(self) -> int:
        """Largest integer code."""
        return 2 ** (self.bits - 1) - 1


@dataclass(frozen=True)
class QParams:
    """Scale and zero point (per tensor, or per channel along `axis`)."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    qmin: int
    qmax: int
    axis: int | None

    def _shaped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.axis is None:
            return self.scale, self.zero_point
        shape = [1] * x.dim()
        shape[self.axis] = -1
        return self.scale.view(shape), self.zero_point.view(shape)


def calibrate(x: torch.Tensor, config: QuantConfig) -> QParams:
    """Quantisation parameters for x under `config`."""
    if config.axis is not None and not -x.dim() <= config.axis < x.dim():
        raise ValueError(
            f"quantisation axis {config.axis} is out of range for shape {tuple(x.shape)}"
        )
    axis = None if config.axis is None else config.axis % x.dim()
    x32 = x.detach().float()
    # one row per channel (a single row per tensor): absmax / min / max reduce rows at once, so
    # a weight's many channels (or groups, `quantize_weight`) cost no Python loop
    rows = x32.reshape(1, -1) if axis is None else x32.movedim(axis, 0).reshape(x.shape[axis], -1)
    tiny = torch.finfo(torch.float32).tiny
    if config.symmetric:
        if config.method == "kl":
            thresholds = torch.tensor(
                [kl_threshold(c, config.kl_bins, config.qmax + 1) for c in rows]
            )
        else:
            thresholds = rows.abs().amax(1)
        scale = (thresholds / config.qmax).clamp_min(tiny)
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        lo = rows.amin(1).clamp(max=0.0)
        hi = rows.amax(1).clamp(min=0.0)
        scale = ((hi - lo) / (config.qmax - config.qmin)).clamp_min(tiny)
        zero_point = (config.qmin - torch.round(lo / scale)).clamp(config.qmin, config.qmax).int()
    if axis is None:
        scale, zero_point = scale.reshape(()), zero_point.reshape(())
    return QParams(scale.to(x.device), zero_point.to(x.device), config.qmin, config.qmax, axis)


def quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """int8 codes of x."""
    scale, zero_point = qp._shaped(x)
    q = torch.round(x.float() / scale) + zero_point
    return q.clamp(qp.qmin, qp.qmax).to(torch.int8)


def dequantize(q: torch.Tensor, qp: QParams, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values (q - zero_point) · scale."""
    scale, zero_point = qp._shaped(q)
    return ((q.float() - zero_point) * scale).to(dtype)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax):
        codes = torch.round(x.float() / scale) + zero_point
        ctx.save_for_backward((codes >= qmin) & (codes <= qmax))
        return ((codes.clamp(qmin, qmax) - zero_point) * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None, None


def fake_quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Quantise-dequantise in x's dtype; the gradient passes unchanged where x is representable
    and is zero where it was clipped (straight-through estimator)."""
    scale, zero_point = qp._shaped(x)
    return _FakeQuantSTE.apply(x, scale, zero_point, qp.qmin, qp.qmax)


def kl_threshold(x: torch.Tensor, bins: int = 2048, quant_bins: int = 128) -> float:
    """Clipping threshold for |x| minimising KL(P_clipped || Q_quantised) over histogram cuts."""
    values = x.detach().float().abs().flatten().cpu().numpy()
    absmax = float(values.max()) if values.size else 0.0
    if absmax == 0.0:
        return 0.0
    hist, edges = np.histogram(values, bins=bins, range=(0.0, absmax))
    hist = hist.astype(np.float64)
    best_cut, best_kl = bins, np.inf
    for cut in range(quant_bins, bins + 1):
        kl = _kl_of_cut(hist, cut, quant_bins)
        if kl < best_kl:
            best_cut, best_kl = cut, kl
    return float(edges[best_cut])


def _kl_of_cut(hist: np.ndarray, cut: int, quant_bins: int) -> float:
    kept = hist[:cut]
    p = kept.copy()
    p[-1] += hist[cut:].sum()  # clipped outliers pile up in the last kept bin
    starts = (np.arange(quant_bins) * cut) // quant_bins
    chunk_of_bin = np.repeat(np.arange(quant_bins), np.diff(np.append(starts, cut)))
    nonzero = kept > 0
    chunk_sum = np.add.reduceat(kept, starts)
    chunk_nonzero = np.add.reduceat(nonzero.astype(np.float64), starts)
    # Each merged bin's mass spreads evenly over the fine bins that had any.
    q = np.where(nonzero, chunk_sum[chunk_of_bin] / np.maximum(chunk_nonzero[chunk_of_bin], 1), 0.0)
    p_sum, q_sum = p.sum(), q.sum()
    if p_sum == 0 or q_sum == 0:
        return np.inf
    p, q = p / p_sum, q / q_sum
    mask = p > 0
    q_safe = np.where(q > 0, q, 1e-10)
    return float(np.sum(p[mask] * np.log(p[mask] / q_safe[mask])))


# -- weight-only quantisation of Linear weights (quantized checkpoints) --------------------------


@dataclass(frozen=True)
class WeightScheme:
    """How a Linear weight [out, in] is quantised (round to nearest, weight only)."""

    bits: int
    """8 or 4."""
    group_size: int | None = None
    """Inputs sharing one scale along a row; None: one scale per output channel."""
    symmetric: bool = True
    """Zero point 0 (symmetric) or a per-group zero point over [min, max] (affine)."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"weight quantisation bits must be 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group size must be >= 1, got {self.group_size}")
        if self.bits == 4 and self.group_size is not None and self.group_size % 2:
            raise ValueError(
                f"int4 groups pack two codes a byte: group size {self.group_size} is odd"
            )

    def groups(self, columns: int) -> int:
        """Scales per row of a weight with `columns` inputs (ValueError when they do not divide)."""
        if self.group_size is None:
            return 1
        if columns % self.group_size:
            raise ValueError(
                f"a row of {columns} inputs does not split into groups of {self.group_size}"
            )
        return columns // self.group_size


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantised Linear weight: codes, scales and (affine) zero points."""

    codes: torch.Tensor
    """int8 [out, in], each in the scheme's code range."""
    scale: torch.Tensor
    """float32 [out, groups]."""
    zero_point: torch.Tensor | None
    """int8 [out, groups] for affine schemes, None for symmetric ones."""


def quantize_weight(weight: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    """Round-to-nearest codes of a 2-D weight: per output channel, or per `group_size` inputs."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight takes a 2-D weight, got shape {tuple(weight.shape)}")
    out, columns = weight.shape
    groups = scheme.groups(columns)
    rows = weight.detach().float().reshape(out * groups, columns // groups)
    qp = calibrate(rows, QuantConfig(bits=scheme.bits, symmetric=scheme.symmetric, axis=0))
    codes = quantize(rows, qp).reshape(out, columns)
    zero = qp.zero_point.to(torch.int8).reshape(out, groups) if not scheme.symmetric else None
    return QuantizedWeight(codes, qp.scale.reshape(out, groups), zero)


def dequantize_weight(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight (codes - zero) · scale, per group, in `dtype`."""
    out, columns = q.codes.shape
    groups = q.scale.shape[1]
    codes = q.codes.float().reshape(out, groups, columns // groups)
    if q.zero_point is not None:
        codes = codes - q.zero_point.float().unsqueeze(-1)
    return (codes * q.scale.float().unsqueeze(-1)).reshape(out, columns).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], even last dim → uint8, two a byte (element 2j low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {codes.shape[-1]}")
    nibbles = (codes.to(torch.int16) & 0x0F).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: int8 codes in [-8, 7]."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    both = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)
    return torch.where(both >= 8, both - 16, both).to(torch.int8)
