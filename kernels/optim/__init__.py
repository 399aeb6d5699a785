"""Optimizer registry: the `--optimizer` choices and how each is built for this device.

"adam" is torch's Adam (L2 decay coupled into the gradient); "adamw" torch's AdamW with
decoupled decay (torch's fused kernel where every parameter is a plain CPU/CUDA float tensor —
~3x faster than foreach on CPU, the same update up to fp32 rounding — else multi-tensor
foreach kernels, e.g. for DTensor parameters); "fused_adam" AdamW with one fused kernel
(torch's fused implementation on CPU/CUDA, torch_npu's NpuFusedAdamW on Ascend); "cadam" the
low-memory sign-momentum optimizer in kernels.optim.cadam; "sgd" torch's SGD (momentum set per
param group). Megatron's `--optimizer adam` decays weights the AdamW way: map it to "adamw".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels import device
from kernels.optim.cadam import Cadam

__all__ = ["OPTIMIZERS", "Cadam", "build_optimizer"]


def _adam(params, *, lr, weight_decay, betas, eps, **_: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


FUSED_DEVICES = ("cpu", "cuda")
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def can_fuse_adamw(params: Any) -> bool:
    """Whether torch's fused AdamW takes every tensor of `params` (params or param-group dicts).

    Plain tensors only (DTensors keep the foreach path), on one device type it fuses, float.
    """
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type in FUSED_DEVICES
        and t.dtype in FUSED_DTYPES
        for t in tensors
    )


def _adamw(params, *, lr, weight_decay, betas, eps, **_: Any) -> torch.optim.Optimizer:
    params = list(params)
    fused = can_fuse_adamw(params)
    return torch.optim.AdamW(
        params,
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        foreach=None if fused else True,
        fused=fused or None,
    )


def _fused_adam(params, *, lr, weight_decay, betas, eps, **_: Any) -> torch.optim.Optimizer:
    if device.current().type == "npu":
        # NPU only: kernels.npu imports torch_npu
        from kernels.npu.optim import fused_adamw

        return fused_adamw(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=True
    )


def _cadam(params, *, lr, weight_decay, betas, compute_dtype=torch.float16, **_: Any):
    return Cadam(params, lr=lr, betas=betas, weight_decay=weight_decay, compute_dtype=compute_dtype)


def _sgd(params, *, lr, weight_decay, momentum=0.0, **_: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": _adam,
    "adamw": _adamw,
    "fused_adam": _fused_adam,
    "cadam": _cadam,
    "sgd": _sgd,
}


def build_optimizer(
    name: str,
    param_groups: Any,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    **extra: Any,
) -> torch.optim.Optimizer:
    """The optimizer `name` over `param_groups` (params or dicts with per-group overrides).

    `extra` passes optimizer-specific options: `momentum` (sgd), `compute_dtype` (cadam).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer {name!r} is not known; choose one of {sorted(OPTIMIZERS)}")
    if not lr > 0:
        raise ValueError(f"--lr must be > 0, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {weight_decay}")
    if eps <= 0:
        raise ValueError(f"--adam-eps must be > 0, got {eps}")
    return OPTIMIZERS[name](
        param_groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, **extra
    )
