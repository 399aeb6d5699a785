"""Mixed precision: how parameters, gradients and the optimizer step are typed.

Modes (chosen by `plan_precision` from --fp16/--bf16, the ZeRO stage and whether FSDP2 applies):

| mode     | model params | grads the optimizer sees          | master weights               |
| -------- | ------------ | --------------------------------- | ---------------------------- |
| fp32     | fp32         | fp32                              | the params themselves        |
| master   | bf16/fp16    | fp32 copies (or cast per bucket)  | fp32 copies kept here        |
| fsdp     | fp32 shards  | fp32 (FSDP2 reduces in fp32)      | FSDP2's sharded fp32 params  |
| autocast | fp32         | fp32                              | the params (ZeRO-1 + bf16)   |

In `master` mode the default keeps a persistent fp32 gradient buffer per parameter (Megatron's
`main_grad`, 4 bytes/param). `--release-fp32-grad` keeps none: at the step each low-precision
gradient is cast to fp32 in buckets, the inner optimizer steps that bucket, and the fp32 copy is
freed — the same arithmetic (the unscale and clip factor is applied once, after the cast, in both
paths), so results are identical while 4N bytes are not held through forward and backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from training.run_sections import PrecisionSection

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Elements cast to fp32 at once under --release-fp32-grad (bounds the transient copy).
RELEASE_BUCKET_NUMEL = 1 << 24


@dataclass(frozen=True)
class PrecisionPlan:
    """Resolved precision settings for one run."""

    mode: str
    compute_dtype: torch.dtype
    release_fp32_grad: bool = False

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model's parameters are stored in."""
        return self.compute_dtype if self.mode == "master" else torch.float32

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[None]:
        """The forward-pass context: torch.autocast in `autocast` mode, else a no-op."""
        if self.mode == "autocast":
            return torch.autocast(device_type=device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext()


def plan_precision(
    precision: PrecisionSection, zero_stage: int, sharding_ranks: int
) -> PrecisionPlan:
    """Pick the mode for --fp16/--bf16 under ZeRO stage `zero_stage`.

    `sharding_ranks` is the data x context-parallel size FSDP2 would shard over. ZeRO 2/3 take
    low precision from FSDP2's mixed-precision policy, and with a single such rank no FSDP2 is
    applied: those runs get ZeRO 0's fp32 master weights instead of silently training in fp32.
    """
    name = precision.dtype_name
    dtype = DTYPES[name]
    if name == "fp32":
        return PrecisionPlan("fp32", dtype)
    if zero_stage >= 2 and sharding_ranks > 1:
        return PrecisionPlan("fsdp", dtype)
    if zero_stage == 1:
        return PrecisionPlan("autocast", dtype)
    return PrecisionPlan("master", dtype, release_fp32_grad=precision.release_fp32_grad)


@dataclass(frozen=True)
class StepStats:
    """Outcome of one optimizer step."""

    grad_norm: float
    found_inf: bool


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grads_nonfinite(grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
    """Whether any gradient holds Inf/NaN on any rank (agreed across the job).

    A full pass over the gradients; the optimizer step reads the same fact from the gradient
    norm instead (`norm_nonfinite`), which it computes anyway.
    """
    local = any(not torch.isfinite(_local(g)).all() for g in grads)
    return _agree(local, group)


def norm_nonfinite(norm: float, group: dist.ProcessGroup | None = None) -> bool:
    """Whether the gradient norm `norm` is Inf/NaN on any rank (agreed across the job).

    An Inf or NaN in any gradient makes its L2 norm Inf/NaN, so this replaces a separate
    Inf/NaN pass over every gradient (the same skip decision, one scalar instead of N tensors);
    a norm whose fp32 sum of squares overflows counts as an overflow too.
    """
    return _agree(not math.isfinite(norm), group)


def _agree(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """`flag` OR-ed over the ranks of `group` (as it is without a multi-rank process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor(1.0 if flag else 0.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def global_grad_norm(grads: list[torch.Tensor]) -> float:
    """L2 norm over all gradients, accumulated in fp32 (sharded DTensor grads reduced globally)."""
    if not grads:
        return 0.0
    norms: list[torch.Tensor] = []
    for same_kind in _split_dtensors(grads):
        if isinstance(same_kind[0], DTensor):
            norms += [_full(torch.linalg.vector_norm(g, dtype=torch.float32)) for g in same_kind]
        else:  # one multi-tensor kernel for the plain gradients
            norms += torch._foreach_norm(same_kind, 2, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms))
    return float(total)


def _split_dtensors(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in lists of one kind: plain tensors, and DTensors per mesh."""
    parts: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        parts.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(parts.values())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class PrecisionOptimizer:
    """An inner optimizer plus loss-scale unscaling, overflow skipping, clipping and master weights.

    `step(loss_scale)` unscales, checks for Inf/NaN through the gradient norm (skipping the
    update when it is not finite), clips to
    `clip_grad`, updates, and in `master` mode copies the fp32 masters back into the model.
    """

    def __init__(
        self,
        model_groups: list[dict],
        build_inner: Callable[[list[dict]], torch.optim.Optimizer],
        plan: PrecisionPlan,
        *,
        clip_grad: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan, self.clip_grad, self.group = plan, clip_grad, group
        self.model_params: list[torch.Tensor] = [p for g in model_groups for p in g["params"]]
        self.master_params: list[torch.Tensor]
        if plan.mode == "master":
            self.master_params = [
                p.detach().clone().float().requires_grad_(True) for p in self.model_params
            ]
            lookup = {id(p): m for p, m in zip(self.model_params, self.master_params, strict=True)}
            inner_groups = [
                {**g, "params": [lookup[id(p)] for p in g["params"]]} for g in model_groups
            ]
        else:
            self.master_params = self.model_params
            inner_groups = model_groups
        self.inner = build_inner(inner_groups)
        self._fp32_grads: list[torch.Tensor] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (the LR scheduler writes `lr` here)."""
        return self.inner.param_groups

    def zero_grad(self) -> None:
        """Drop the model's gradients (the persistent fp32 buffers, if any, are overwritten later)."""
        for p in self.model_params:
            p.grad = None

    def persistent_grad_bytes(self) -> int:
        """Bytes held between steps by fp32 gradient copies (0 under --release-fp32-grad)."""
        if self._fp32_grads is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._fp32_grads)

    def step(self, loss_scale: float = 1.0) -> StepStats:
        """Unscale, check, clip and apply the gradients; returns the (unscaled) norm and overflow flag."""
        pairs = [
            (p, m)
            for p, m in zip(self.model_params, self.master_params, strict=True)
            if p.grad is not None
        ]
        grads = [p.grad for p, _ in pairs]
        norm = global_grad_norm(grads) / loss_scale  # type: ignore[arg-type]
        if norm_nonfinite(norm, self.group):
            self.zero_grad()
            return StepStats(grad_norm=math.nan, found_inf=True)
        clip = min(1.0, self.clip_grad / (norm + 1e-6)) if self.clip_grad > 0 else 1.0
        factor = clip / loss_scale
        if self.plan.mode != "master":
            if factor != 1.0:
                # foreach kernels refuse a mix of DTensor and plain gradients (expert parallel).
                for same_kind in _split_dtensors(grads):  # type: ignore[arg-type]
                    torch._foreach_mul_(same_kind, factor)
            self.inner.step()
        elif self.plan.release_fp32_grad:
            for bucket in _buckets(pairs):
                for p, m in bucket:
                    m.grad = p.grad.float().mul_(factor)  # type: ignore[union-attr]
                    p.grad = None
                self.inner.step()
                for p, m in bucket:
                    m.grad = None
                    p.data.copy_(m.data)
        else:
            self._step_with_buffers(pairs, factor)
        self.zero_grad()
        return StepStats(grad_norm=norm, found_inf=False)

    def _step_with_buffers(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], factor: float
    ) -> None:
        if self._fp32_grads is None:
            self._fp32_grads = [torch.empty_like(m) for m in self.master_params]
        index = {id(m): i for i, m in enumerate(self.master_params)}
        for p, m in pairs:
            buf = self._fp32_grads[index[id(m)]]
            buf.copy_(p.grad).mul_(factor)  # type: ignore[arg-type]
            m.grad = buf
        self.inner.step()
        for p, m in pairs:
            m.grad = None
            p.data.copy_(m.data)

    def state_dict(self) -> dict:
        """Inner optimizer state plus the fp32 masters (master mode)."""
        state: dict[str, Any] = {"optimizer": self.inner.state_dict()}
        if self.plan.mode == "master":
            state["master_params"] = [m.detach() for m in self.master_params]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output."""
        self.inner.load_state_dict(state["optimizer"])
        if self.plan.mode == "master" and "master_params" in state:
            for p, m, saved in zip(
                self.model_params, self.master_params, state["master_params"], strict=True
            ):
                m.data.copy_(saved)
                p.data.copy_(saved)


def _buckets(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    bucket: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    for pair in pairs:
        bucket.append(pair)
        size += pair[1].numel()
        if size >= RELEASE_BUCKET_NUMEL:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
