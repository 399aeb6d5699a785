"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): weight-only quantization of one Linear weight that rounds its
columns one at a time and moves each column's rounding error onto the columns not yet rounded,
weighted by the inverse Hessian of the layer's squared output error on calibration inputs.

Shapes: W [O, I] (O outputs, I inputs), X [N, I] (N calibration rows), H [I, I].

- H = 2 Σ x xᵀ / N over the layer's calibration inputs (`HessianAccumulator`); inputs that never
  fire (a zero diagonal) get H_ii = 1 and a zero column, as the reference does;
- dampening: λ = percdamp · mean(diag H) added to the diagonal (percdamp 0.01 by default);
- U = the upper Cholesky factor of H⁻¹; column i's error e = (w_i − q(w_i)) / U_ii is
  subtracted from the later columns as e · U_{i, i+1:};
- lazy batch updates: inside a block of columns (128, rounded up to whole groups) the update
  reaches only the block; the rest of W gets the block's errors in one matrix product when the
  block is done (the same arithmetic, in another order);
- group-wise scales (and zero points) are computed from the error-updated weights when the
  group's first column is reached, with `kernels.quantization`'s round-to-nearest rules, so the
  result is an ordinary `QuantizedWeight` (same codes, scales and zero points layout);
- act-order (`act_order=True`): columns are visited by decreasing H_ii; with groups, each
  group's scale is fixed up front from the original weights ("static groups", also available
  in natural order), so the groups stay contiguous input ranges as the checkpoint format stores
  them.

Computed in float64 (a few hundred MiB at most for a 4096-input layer on CPU) so that the blocked
and the column-by-column forms round every column the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quantization import (
    QParams,
    QuantConfig,
    QuantizedWeight,
    WeightScheme,
    calibrate,
    quantize,
)

DEFAULT_BLOCK_SIZE = 128
"""Columns per lazy-batch block (the paper's B)."""
DEFAULT_PERCDAMP = 0.01
"""Dampening as a fraction of the mean Hessian diagonal (the paper's λ)."""


@dataclass(frozen=True)
class GptqSettings:
    """How GPTQ rounds a weight (beyond its `WeightScheme`)."""

    percdamp: float = DEFAULT_PERCDAMP
    """λ / mean(diag H): the dampening added to H's diagonal."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Columns per lazy-batch block (rounded up to whole groups)."""
    act_order: bool = False
    """Visit columns by decreasing Hessian diagonal (static groups)."""
    static_groups: bool = False
    """Fix every group's scale up front from the original weights (always under act-order;
    llm-compressor's and gptqmodel's option of that name)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.percdamp <= 1.0:
            raise ValueError(f"GPTQ dampening must be in (0, 1], got {self.percdamp}")
        if self.block_size < 1:
            raise ValueError(f"GPTQ block size must be >= 1, got {self.block_size}")


class HessianAccumulator:
    """H = 2 Σ x xᵀ / N over every row x of the inputs given to `add` (each call's product in
    float32, the sum in float64)."""

    def __init__(self, columns: int) -> None:
        self.hessian = torch.zeros(columns, columns, dtype=torch.float64)
        """The running 2 X Xᵀ / N."""
        self.rows = 0
        """Input rows seen."""

    def add(self, x: torch.Tensor) -> None:
        """Adds the inputs x [..., I] (every leading dimension is a row)."""
        x_NI = x.detach().reshape(-1, x.shape[-1]).float()
        n = x_NI.shape[0]
        if n == 0:
            return
        total = self.rows + n
        self.hessian *= self.rows / total
        # the product in float32 (half float64's time on CPU; what llm-compressor accumulates
        # in), the running sum in float64
        self.hessian += (2.0 / total) * (x_NI.T @ x_NI).double()
        self.rows = total


def _group_params(block_OG: torch.Tensor, scheme: WeightScheme) -> QParams:
    """Per-row round-to-nearest parameters of columns sharing one scale (quantize_weight's)."""
    return calibrate(block_OG, QuantConfig(bits=scheme.bits, symmetric=scheme.symmetric, axis=0))


def _round_column(w_O: torch.Tensor, qp: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, dequantized values in float64) of one column under per-row parameters."""
    codes = quantize(w_O.unsqueeze(1), qp).squeeze(1)
    scale = qp.scale.to(torch.float64)
    zero = qp.zero_point.to(torch.float64)
    return codes, (codes.to(torch.float64) - zero) * scale


def prepare_hessian(
    hessian: torch.Tensor, weight: torch.Tensor, percdamp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W in float64 with dead inputs zeroed, the dampened H) — GPTQ's preprocessing."""
    h = hessian.to(torch.float64).clone()
    w = weight.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    damp = percdamp * torch.mean(torch.diagonal(h))
    h += damp * torch.eye(h.shape[0], dtype=torch.float64)
    return w, h


def inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H⁻¹ (H⁻¹ = Uᵀ U), ValueError when H is not definite."""
    factor, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise ValueError(
            "GPTQ: the calibration Hessian is not positive definite even after dampening; "
            "use more calibration samples or a larger dampening"
        )
    inverse = torch.cholesky_inverse(factor)
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: WeightScheme,
    settings: GptqSettings = GptqSettings(),
) -> QuantizedWeight:
    """GPTQ codes of a 2-D weight [O, I] given its inputs' Hessian [I, I] (see the module doc)."""
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"gptq_quantize: weight {tuple(weight.shape)} and Hessian {tuple(hessian.shape)} "
            "do not match ([O, I] and [I, I])"
        )
    out, columns = weight.shape
    groups = scheme.groups(columns)
    group = columns // groups
    w, h = prepare_hessian(hessian, weight, settings.percdamp)
    order = torch.arange(columns)
    if settings.act_order:
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    static = settings.act_order or settings.static_groups or scheme.group_size is None
    # per-group parameters fixed up front (per channel, or static groups under act-order)
    fixed = [_group_params(w[:, g * group : (g + 1) * group], scheme) for g in range(groups)]
    params: list[QParams | None] = list(fixed) if static else [None] * groups
    w = w[:, order]
    u = inverse_cholesky(h[order][:, order])
    codes = torch.zeros(out, columns, dtype=torch.int8)
    # a block holds whole groups, so a group's parameters come from its fully updated columns
    block = -(-settings.block_size // group) * group if scheme.group_size is not None else 0
    block = block or settings.block_size
    for start in range(0, columns, block):
        stop = min(start + block, columns)
        w_block = w[:, start:stop].clone()
        err_block = torch.zeros_like(w_block)
        u_block = u[start:stop, start:stop]
        for i in range(stop - start):
            column = int(order[start + i])
            g = column // group
            if params[g] is None:  # natural order: the group's first column is reached now
                params[g] = _group_params(w_block[:, i : i + group], scheme)
            qp = params[g]
            assert qp is not None
            c, q = _round_column(w_block[:, i], qp)
            codes[:, column] = c
            err = (w_block[:, i] - q) / u_block[i, i]
            w_block[:, i:] -= err.unsqueeze(1) * u_block[i, i:].unsqueeze(0)
            err_block[:, i] = err
        w[:, stop:] -= err_block @ u[start:stop, stop:]
    return _assemble(codes, params, scheme, out, groups)


def _assemble(
    codes: torch.Tensor,
    params: list[QParams | None],
    scheme: WeightScheme,
    out: int,
    groups: int,
) -> QuantizedWeight:
    """The QuantizedWeight of codes [O, I] and each group's per-row parameters."""
    done = [p for p in params if p is not None]
    assert len(done) == groups
    scale = torch.stack([p.scale.float() for p in done], dim=1).reshape(out, groups)
    zero = None
    if not scheme.symmetric:
        zero = torch.stack([p.zero_point for p in done], dim=1).to(torch.int8).reshape(out, groups)
    return QuantizedWeight(codes, scale.contiguous(), zero)
