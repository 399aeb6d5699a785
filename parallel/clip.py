"""Gradient-norm clipping that is correct for sharded (DTensor) and replicated gradients."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    extra_group: dist.ProcessGroup | None = None,
    clip_also: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients in place to a total norm of `max_norm`; return the total norm (a plain tensor).

    The norm is over the *global* gradient: DTensor shards (FSDP2/HSDP, tensor parallel) are
    reduced over their mesh, replicated gradients (DDP, ZeRO-1 after the all-reduce) count once.
    `extra_group` all-reduces the norm over ranks that hold disjoint parameters and that no
    DTensor knows about (pipeline stages). `clip_also` are parameters scaled by the same
    coefficient but left out of the norm: a second holder of a tied weight (a pipeline's last-stage
    head copy), whose gradient the norm already counts once. `max_norm <= 0` computes the norm
    without clipping.
    """
    with_grad = [p for p in parameters if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    norm_type = float(norm_type)
    # foreach kernels refuse a mix of plain tensors and DTensors, or of meshes (expert-parallel
    # experts next to replicated parameters): one norm per kind, then the norm of those.
    kinds: dict[Any, list[torch.Tensor]] = {}
    for p in with_grad:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    norms = []
    for params in kinds.values():
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach=None)
        # A DTensor norm is a partial result until its pending reduction is materialised.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if extra_group is not None:
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=extra_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=extra_group)
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        for p in clip_also:
            if p.grad is not None:
                kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        for params in kinds.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=None)
    return total
