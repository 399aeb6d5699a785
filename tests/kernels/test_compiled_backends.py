"""The torch.compile-generated backends (CUDA's default for norm, rotary, SwiGLU and cross
entropy) against their references, forward and backward.

On a CPU-only machine the same compiled functions run through inductor's C++ backend, which
checks the wiring (arguments, dtypes, the chunked cross entropy's custom backward); the `gpu`
tests run them as the generated Triton kernels CUDA uses, in bf16 and fp16.
Tolerances: fp32 1e-5 (fusion reorders the reductions); 16-bit one rounding of the output
(bf16 2e-2, fp16 2e-3 relative) — the references upcast to fp32 internally as the kernels do.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.activation import SWIGLU, SWIGLU_PACKED
from kernels.cross_entropy import PER_TOKEN
from kernels.norm import RMS_NORM
from kernels.registry import Op
from kernels.rotary import APPLY_ROTARY

TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def _inputs(op: str, dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], tuple]:
    """(differentiable tensors, extra arguments) for one call of `op`."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    if op == "rms_norm":
        return [leaf(3, 7, 64), leaf(64)], (1e-6,)
    if op == "apply_rotary":
        angles = torch.randn(3, 7, 32, generator=gen).to(device)
        return [leaf(3, 7, 4, 32)], (angles.cos(), angles.sin())
    if op == "swiglu":
        return [leaf(3, 7, 48), leaf(3, 7, 48)], ()
    if op == "swiglu_packed":
        return [leaf(3, 7, 96)], ()
    labels = torch.randint(0, 300, (21,), generator=gen).to(device)
    labels[3] = -100
    valid = labels >= 0
    return [leaf(21, 300)], (labels, valid, 1e-4, 8)  # 8-row chunks: three chunks


OPS: dict[str, Op] = {
    "rms_norm": RMS_NORM,
    "apply_rotary": APPLY_ROTARY,
    "swiglu": SWIGLU,
    "swiglu_packed": SWIGLU_PACKED,
    "cross_entropy": PER_TOKEN,
}


def _call(fn: Callable, tensors: list[torch.Tensor], extra: tuple, op: str) -> torch.Tensor:
    if op == "rms_norm":
        return fn(tensors[0], tensors[1], *extra)
    return fn(*tensors, *extra)


def _check(op_name: str, dtype: torch.dtype, device: str) -> None:
    op = OPS[op_name]
    tensors, extra = _inputs(op_name, dtype, device)
    out = _call(op.get("compiled"), tensors, extra, op_name)
    ref = _call(op.reference, tensors, extra, op_name)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    got = torch.autograd.grad(out, tensors, upstream)
    want = torch.autograd.grad(ref, tensors, upstream)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOLERANCES[dtype])


# Measured slower than their eager reference on CUDA (bench/RESULTS.md): selectable, not default.
NOT_PREFERRED_ON_CUDA = {"swiglu", "swiglu_packed"}


def test_compiled_backends_are_cuda_defaults_where_they_measured_faster() -> None:
    for op in OPS.values():
        first = "reference" if op.name in NOT_PREFERRED_ON_CUDA else "compiled"
        assert op.candidates("cuda")[0] == first, op.name
        assert "compiled" in op.candidates("cuda"), op.name
        assert "compiled" not in op.candidates("cpu"), op.name


@pytest.mark.slow
@pytest.mark.parametrize("op_name", list(OPS))
def test_compiled_backend_matches_reference_on_cpu(op_name: str) -> None:
    _check(op_name, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op_name", list(OPS))
def test_compiled_backend_matches_reference_on_cuda(op_name: str, dtype: torch.dtype) -> None:
    _check(op_name, dtype, "cuda")
