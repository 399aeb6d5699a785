"""Data parallelism and ZeRO stages, applied to a model from outside.

| zero_stage | parameters                    | gradients                  | optimizer state |
| ---------- | ----------------------------- | -------------------------- | --------------- |
| 0          | replicated (DDP `replicate`)  | all-reduced                | replicated      |
| 1          | replicated (DDP `replicate`)  | all-reduced                | sharded (dim 0) |
| 2          | FSDP2, kept unsharded fwd→bwd | reduce-scattered           | sharded         |
| 3          | FSDP2, resharded after fwd    | reduce-scattered           | sharded         |

HSDP (zero 2/3 with `hsdp=True`) shards inside `dp_shard` and replicates across `dp_replicate`
on a 2-D mesh. ZeRO-1's sharded optimizer lives in `parallel.zero1`: wrap the
optimizer with `wrap_optimizer` after building it over `model.parameters()`.

Gradient accumulation: wrap every micro-batch but the last in `no_sync(model)`. Under ZeRO 0/1
this skips the all-reduce (gradients accumulate unsharded, as DDP's `no_sync`); under ZeRO 2/3
it keeps unsharded gradients until the last micro-batch (fewer collectives, more memory) — for
the memory-lean ZeRO-2/3 behaviour simply do not use `no_sync` and FSDP2 reduce-scatters into
the sharded gradient after every micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import cast

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from kernels import device
from parallel.clip import clip_grad_norm_
from parallel.config import ParallelConfig
from parallel.zero1 import ZeroOneOptimizer

__all__ = [
    "ZERO_STAGES",
    "apply_data_parallel",
    "apply_run_data_parallel",
    "build_dp_mesh",
    "clip_grad_norm_",
    "dp_mesh_1d",
    "no_sync",
    "set_gradient_sync",
    "set_prefetch",
    "wrap_optimizer",
]

ZERO_STAGES = (0, 1, 2, 3)
MESH_DIMS = ("dp_replicate", "dp_shard")


def build_dp_mesh(world_size: int, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    """A 2-D device mesh with named axes (`dp_replicate`, `dp_shard`) over all `world_size` ranks.

    Either size may be -1 to take what the other leaves (`world_size // other`).
    """
    if dp_replicate == -1 and dp_shard == -1:
        raise ValueError("--dp-replicate and --dp-shard cannot both be -1; fix one of them")
    if dp_replicate == -1:
        dp_replicate = world_size // max(dp_shard, 1)
    if dp_shard == -1:
        dp_shard = world_size // max(dp_replicate, 1)
    if dp_replicate < 1 or dp_shard < 1 or dp_replicate * dp_shard != world_size:
        raise ValueError(
            f"--dp-replicate ({dp_replicate}) x --dp-shard ({dp_shard}) must equal the data-parallel "
            f"world size {world_size}; pick sizes whose product is {world_size}"
        )
    return init_device_mesh(
        device.current().type, (dp_replicate, dp_shard), mesh_dim_names=MESH_DIMS
    )


def dp_mesh_1d(mesh: DeviceMesh) -> DeviceMesh:
    """All data-parallel ranks of `mesh` as one 1-D mesh (the DDP / flat-FSDP group)."""
    if mesh.ndim == 1:
        return mesh
    replicate_size, shard_size = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if replicate_size == 1:
        return mesh["dp_shard"]
    if shard_size == 1:
        return mesh["dp_replicate"]
    return mesh[MESH_DIMS]._flatten("dp")


def _check_options(
    mesh: DeviceMesh, zero_stage: int, hsdp: bool, cpu_offload: bool, param_dtype: torch.dtype
) -> None:
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"--zero-stage must be one of {ZERO_STAGES}, got {zero_stage}")
    if hsdp and zero_stage < 2:
        raise ValueError(f"--hsdp needs --zero-stage 2 or 3 (sharded parameters), got {zero_stage}")
    if hsdp and (mesh.ndim != 2 or (mesh.mesh_dim_names or ("",))[0] != MESH_DIMS[0]):
        raise ValueError(
            f"--hsdp needs a 2-D mesh ({MESH_DIMS[0]!r}, shard axis); build it with build_dp_mesh "
            "or ParallelDims.hsdp_mesh"
        )
    if cpu_offload and zero_stage < 2:
        raise ValueError(
            f"--cpu-offload moves sharded parameters and optimizer state to the host and needs "
            f"--zero-stage 2 or 3, got {zero_stage}"
        )
    if zero_stage < 2 and param_dtype != torch.float32:
        raise ValueError(
            f"low-precision parameters (param_dtype={param_dtype}) need FSDP2's mixed-precision "
            f"policy: use --zero-stage 2 or 3, or keep fp32 parameters under ZeRO-{zero_stage}"
        )


def apply_data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    zero_stage: int,
    hsdp: bool = False,
    cpu_offload: bool = False,
    pin_memory: bool = False,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    prefetch_layers: int = 0,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Apply DDP (ZeRO 0/1) or FSDP2 (ZeRO 2/3, HSDP) to `model` in place and return it.

    FSDP2 wraps each transformer block (`model.layers[i]`) and then the root, so one block's
    parameters are gathered at a time; parameter names (`state_dict` keys) are unchanged.
    `param_dtype`/`reduce_dtype` form the mixed-precision policy: compute in `param_dtype`,
    reduce gradients in `reduce_dtype`, keep fp32 sharded master weights. `prefetch_layers` > 0
    (ZeRO-3) makes block i all-gather blocks i+1..i+N in forward and i-1..i-N in backward
    explicitly, so the gathers overlap compute further ahead than FSDP2's implicit one-block
    backward prefetch (more memory held: N gathered blocks). `ignored_params` (ZeRO 2/3) are
    left to the caller: neither sharded, cast nor reduced (expert parallelism's experts).
    `pin_memory` pins the offloaded shards (`cpu_offload`) where the device is an accelerator;
    on a CPU device the shards never leave host memory, so there is nothing to pin.
    """
    _check_options(mesh, zero_stage, hsdp, cpu_offload, param_dtype)
    if ignored_params and zero_stage < 2:
        raise ValueError(f"ignored_params need FSDP2 (--zero-stage 2 or 3), got {zero_stage}")
    if zero_stage < 2:
        flat = dp_mesh_1d(mesh)
        return replicate(model, device_mesh=flat)

    shard_mesh = mesh if hsdp else dp_mesh_1d(mesh)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    pin = pin_memory and device.current().type != "cpu"
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    reshard = zero_stage == 3
    layers = getattr(model, "layers", None)
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(
            block,
            mesh=shard_mesh,
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=reshard and index < len(blocks) - 1,
            ignored_params=ignored_params,
        )
    fully_shard(
        model,
        mesh=shard_mesh,
        mp_policy=mp_policy,
        offload_policy=offload,
        reshard_after_forward=reshard,
        ignored_params=ignored_params,
    )
    if prefetch_layers > 0:
        if zero_stage != 3:
            raise ValueError(
                f"--zero3-prefetch-layers needs --zero-stage 3, got --zero-stage {zero_stage}"
            )
        set_prefetch(blocks, prefetch_layers)
    return model


def apply_run_data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    par: ParallelConfig,
    param_dtype: torch.dtype,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """`apply_data_parallel` with a run's settings (--zero-stage, --hsdp, --cpu-offload,
    --offload-pin-memory, --zero3-prefetch-layers of its `ParallelConfig`)."""
    return apply_data_parallel(
        model,
        mesh,
        zero_stage=par.zero_stage,
        hsdp=par.hsdp,
        cpu_offload=par.cpu_offload,
        pin_memory=par.offload_pin_memory,
        param_dtype=param_dtype,
        prefetch_layers=par.zero3_prefetch_layers,
        ignored_params=ignored_params,
    )


def set_prefetch(blocks: list[nn.Module], layers: int) -> None:
    """Explicit FSDP2 prefetch: each block gathers the next `layers` blocks' parameters ahead of
    their forward and the previous `layers` blocks' ahead of their backward."""
    sharded = [cast(FSDPModule, block) for block in blocks]
    for index, block in enumerate(sharded):
        block.set_modules_to_forward_prefetch(sharded[index + 1 : index + 1 + layers])
        behind = sharded[max(index - layers, 0) : index]
        block.set_modules_to_backward_prefetch(behind[::-1])


def wrap_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    zero_stage: int,
    param_meshes: Mapping[nn.Parameter, DeviceMesh] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer to train with: ZeRO-1 shards `optimizer`'s state; other stages use it as is.

    ZeRO-1 shards over all data-parallel ranks of `mesh`, except for the parameters in
    `param_meshes`, whose state shards over their own 1-D mesh (expert parallelism's experts).
    """
    if zero_stage == 1:
        return ZeroOneOptimizer(optimizer, model, dp_mesh_1d(mesh), param_meshes)
    return optimizer


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on or off for the next backward passes (no-op if not wrapped)."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally inside the block; reduction resumes on exit."""
    set_gradient_sync(model, False)
    try:
        yield
    finally:
        set_gradient_sync(model, True)
