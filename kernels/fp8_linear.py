"""FP8 linear layers for training: `torch._scaled_mm` with dynamic scaling.

Shapes: x [M, K] (M tokens, K input features), weight [N, K] (N output features), grad [M, N].

A linear layer runs three matmuls; each casts its two operands to FP8 with scales taken along
the dimension it contracts, from the current tensor's absolute maximum (dynamic scaling: no
amax history, so the first step is scaled as well as the last):

| matmul                          | contracts | tensorwise scales | rowwise scales                 |
| ------------------------------- | --------- | ----------------- | ------------------------------ |
| out = x W^T           (forward) | K         | one per tensor    | x per row [M,1], W per row [N] |
| grad_x = grad W       (backward)| N         | one per tensor    | grad per row, W per column [K] |
| grad_W = grad^T x     (backward)| M         | one per tensor    | grad per column, x per column  |

`tensorwise` encodes x and W in e4m3 and the output gradient in `grad_dtype` (e5m2 by default:
Megatron's "hybrid" format; e4m3 on request), and saves the FP8 copies of x and W for the
backward (half the bytes of a bf16 activation). `rowwise` uses e4m3 everywhere (CUDA's row-wise
kernels take no e5m2 operand) and saves x and W in their own dtype, since the backward scales
them along the other dimension. Scales are powers of two, so scaling and unscaling are exact
and cost at most one bit of headroom below the format's largest value.

`torch._scaled_mm` takes its first operand row-major and its second column-major, and on CUDA
needs the second operand's dimensions to be multiples of 16: `fp8_shape_problem` checks K and N
when a layer is converted; the contracted M of grad_W is the token count, and when it is not a
multiple of 16 grad_W is computed in the input's precision from the dequantized operands
instead (the same rule on every device, so the CPU tests exercise both branches). Row-wise
scaling writes bf16 on CUDA, so its matmuls write bf16 and cast to the wanted dtype.

Parameters stay what they were (fp32 or bf16 masters, updated by the ordinary optimizer); the
FP8 copies live only inside one matmul. The reference is `F.linear` in fp32; the tests compare
forward and both gradients at FP8 tolerances (kernels/fp8_linear tests, gpu-marked on CUDA).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
GRANULARITIES = ("tensorwise", "rowwise")
GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}
"""--fp8-grad-format names -> the encoding of output gradients."""
ALIGN = 16
"""cuBLAS/CUTLASS FP8 matmuls need the second operand's dimensions to be multiples of this."""
_AMAX_FLOOR = 1e-12  # an all-zero tensor keeps a finite scale (its codes are all zero anyway)


def quantize(
    t: torch.Tensor, dtype: torch.dtype, dim: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` cast to FP8 `dtype` with a power-of-two scale per tensor (`dim` None) or per slice
    along `dim` (keepdim); returns (codes, inverse scale in fp32), codes * inverse ~= t."""
    largest = torch.finfo(dtype).max
    magnitude = t.abs()
    amax = magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    amax = amax.float().clamp(min=_AMAX_FLOOR)
    scale = torch.exp2(torch.floor(torch.log2(largest / amax)))
    codes = (t.float() * scale).clamp(-largest, largest).to(dtype)
    return codes, scale.reciprocal()


@functools.cache
def rowwise_supported(device_type: str) -> bool:
    """Whether this torch's `_scaled_mm` takes row-wise scales on `device_type`: CUDA's does;
    the CPU kernel of torch 2.13 does, torch 2.11's takes per-tensor scales only (probed once)."""
    if device_type == "cuda":
        return True
    a = torch.zeros(ALIGN, ALIGN, device=device_type).to(E4M3)
    b = _column_major(torch.zeros(ALIGN, ALIGN, device=device_type).to(E4M3))
    rows = torch.ones(ALIGN, 1, device=device_type)
    try:
        torch._scaled_mm(a, b, scale_a=rows, scale_b=rows.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what `_scaled_mm` wants as its second operand)."""
    return t.t().contiguous().t()


def _matmul(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    rowwise: bool,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(a * a_inv) @ (b * b_inv) from FP8 codes; `a` row-major [M, K], `b` column-major [K, N]."""
    dtype = torch.bfloat16 if rowwise else out_dtype
    out = torch._scaled_mm(
        a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=dtype, use_fast_accum=fast_accum
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """x_MK @ w_NK^T with FP8 operands in forward and backward (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_MK: torch.Tensor,
        w_NK: torch.Tensor,
        rowwise: bool,
        grad_dtype: torch.dtype,
    ) -> torch.Tensor:
        dim = 1 if rowwise else None
        x_q, x_inv = quantize(x_MK, E4M3, dim)  # [M,1] or scalar
        w_q, w_inv = quantize(w_NK, E4M3, dim)  # [N,1] or scalar
        # cuBLAS's fast accumulation is what FP8 recipes use for the forward only: gradients
        # accumulate many more terms (M for grad_W) and keep full-precision accumulation.
        out_MN = _matmul(
            x_q,
            x_inv,
            w_q.t(),
            w_inv.view(1, -1) if rowwise else w_inv,
            x_MK.dtype,
            rowwise=rowwise,
            fast_accum=True,
        )
        ctx.rowwise, ctx.grad_dtype = rowwise, grad_dtype
        ctx.dtypes = (x_MK.dtype, w_NK.dtype)
        if rowwise:
            ctx.save_for_backward(x_MK, w_NK)
        else:
            ctx.save_for_backward(x_q, x_inv, w_q, w_inv)
        return out_MN

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_MN: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x_dtype, w_dtype = ctx.dtypes
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_MN = grad_MN.contiguous()
        if ctx.rowwise:
            return (*_rowwise_backward(ctx, grad_MN, need_x, need_w), None, None)
        x_q, x_inv, w_q, w_inv = ctx.saved_tensors
        g_q, g_inv = quantize(grad_MN, ctx.grad_dtype, None)
        grad_x = grad_w = None
        if need_x:
            grad_x = _matmul(g_q, g_inv, _column_major(w_q), w_inv, x_dtype, rowwise=False)
        if need_w:
            if grad_MN.shape[0] % ALIGN:
                x_hp = x_q.to(x_dtype) * x_inv.to(x_dtype)
                grad_w = (grad_MN.t() @ x_hp.to(grad_MN.dtype)).to(w_dtype)
            else:
                a = g_q.t().contiguous()  # [N, M] row-major
                grad_w = _matmul(a, g_inv, _column_major(x_q), x_inv, w_dtype, rowwise=False)
        return grad_x, grad_w, None, None


def _rowwise_backward(
    ctx: Any, grad_MN: torch.Tensor, need_x: bool, need_w: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Row-wise grads: each operand re-scaled along the dimension its matmul contracts."""
    x_MK, w_NK = ctx.saved_tensors
    grad_x = grad_w = None
    if need_x:  # contracts N: grad per row, W per column
        g_q, g_inv = quantize(grad_MN, E4M3, 1)  # [M,1]
        w_q, w_inv = quantize(w_NK, E4M3, 0)  # [1,K]
        grad_x = _matmul(g_q, g_inv, _column_major(w_q), w_inv, x_MK.dtype, rowwise=True)
    if need_w:  # contracts M: grad and x per column
        if grad_MN.shape[0] % ALIGN:
            grad_w = (grad_MN.t() @ x_MK.to(grad_MN.dtype)).to(w_NK.dtype)
        else:
            g_q, g_inv = quantize(grad_MN, E4M3, 0)  # [1,N]
            x_q, x_inv = quantize(x_MK, E4M3, 0)  # [1,K]
            a = g_q.t().contiguous()  # [N, M] row-major
            grad_w = _matmul(
                a, g_inv.view(-1, 1), _column_major(x_q), x_inv, w_NK.dtype, rowwise=True
            )
    return grad_x, grad_w


def fp8_shape_problem(linear: nn.Linear) -> str | None:
    """Why `linear` cannot run FP8 matmuls (a dimension not a multiple of 16), or None."""
    bad = [
        f"{name} {size}"
        for name, size in (
            ("in_features", linear.in_features),
            ("out_features", linear.out_features),
        )
        if size % ALIGN
    ]
    return f"{' and '.join(bad)} not a multiple of {ALIGN}" if bad else None


class Fp8Linear(nn.Linear):
    """An nn.Linear whose matmuls run in FP8 (`_scaled_mm`); same `weight`/`bias` parameters."""

    def __init__(
        self,
        linear: nn.Linear,
        granularity: Literal["tensorwise", "rowwise"],
        grad_dtype: torch.dtype = E5M2,
    ) -> None:
        nn.Module.__init__(self)
        if granularity not in GRANULARITIES:
            raise ValueError(f"FP8 granularity {granularity!r}: use one of {GRANULARITIES}")
        if granularity == "rowwise" and grad_dtype != E4M3:
            raise ValueError(
                "rowwise FP8 encodes gradients in e4m3 only (no e5m2 row-wise kernels)"
            )
        problem = fp8_shape_problem(linear)
        if problem is not None:
            raise ValueError(f"FP8 linear: {problem}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.granularity = granularity
        self.grad_dtype = grad_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b with FP8 operands; under autocast both operands take the autocast dtype."""
        weight = self.weight
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        elif weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        x_MK = x.reshape(-1, self.in_features)
        out_MN = _Fp8Matmul.apply(x_MK, weight, self.granularity == "rowwise", self.grad_dtype)
        out = out_MN.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        dtype = "e5m2" if self.grad_dtype == E5M2 else "e4m3"
        return f"{super().extra_repr()}, fp8={self.granularity}, grad={dtype}"


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The specification: F.linear in fp32."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
