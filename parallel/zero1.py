"""ZeRO-1: parameters and gradients stay replicated, optimizer state is sharded over the DP group.

Every parameter is split along dim 0 exactly as FSDP2 splits it (`torch.chunk` over the DP
ranks; trailing ranks may hold an empty chunk). Each rank steps the wrapped optimizer on its
chunks only — the chunks are views into the replicated parameters, so no second fp32 copy is
kept — and one all-gather per dtype then rebuilds the full parameters on every rank. Gradients
arrive already all-reduced (DDP), so an elementwise optimizer (Adam, AdamW, SGD) makes the same
update as without sharding.

This is our own implementation rather than `torch.distributed.optim.ZeroRedundancyOptimizer`:
that one partitions whole parameters, consolidates its state on one rank to checkpoint, and its
state does not line up with FSDP2's. Ours exposes the state as Shard(0) DTensors under the
parameters' global names (`sharded_state_dict`), the same layout FSDP2 produces, so DCP moves
checkpoints between ZeRO stages and DP sizes without conversion.

A tensor-parallel parameter (a DTensor on the `tp` mesh) is chunked along dim 0 of its local
shard, so a rank's state chunk is "TP shard, then DP chunk of the TP-local dim 0". DTensor applies
placements in mesh-dimension order, so that is exactly a DTensor on a 2-D (tp, dp) mesh with
placements (the parameter's TP placement, Shard(0)), uneven chunks included. DCP only reads this
rank's coordinates from that mesh, so it is assembled from the existing TP and DP process groups
(`DeviceMesh.from_group`: no new groups, no collectives) rather than sliced from the world mesh,
whose slices must keep its axis order (dp before tp).

Parameters need not all shard over the same ranks: `param_meshes` gives some of them their own
1-D shard mesh. Under expert parallelism the experts are `Shard(0)` DTensors on the `ep` mesh,
held alike only by the ranks along `edp` (x `cp`): their state is chunked over those ranks, not
over all data-parallel ranks (which hold different experts), and its DTensors live on an
(ep, edp) mesh built the same way, so a checkpoint still holds the global `[X, ...]` state under
the experts' global names. The all-gather after the step runs per (shard mesh, dtype) in buckets
whose gathered tensor stays under `GATHER_BUCKET_NUMEL` elements (a larger parameter gets a
bucket of its own): one bucket for the whole model held a transient of 1.5 fp32 copies of it
per rank (send + gathered), which made ZeRO-1's peak exceed DDP's (bench/RESULTS.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

GATHER_BUCKET_NUMEL = 1 << 22
"""Elements of one all-gather's output at most (16 MiB of fp32, near DDP's 25 MB buckets), unless
one parameter is larger."""


def gather_buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of `sizes` grouped so that each group's sum is at most `limit` (an
    item larger than `limit` alone in its group)."""
    buckets: list[list[int]] = []
    total = 0
    for index, size in enumerate(sizes):
        if not buckets or total + size > limit:
            buckets.append([])
            total = 0
        buckets[-1].append(index)
        total += size
    return buckets


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _grad_like(grad: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """`grad`'s local tensor laid out like its parameter's (a Shard(0) tensor-parallel embedding
    can receive a Replicate gradient)."""
    full = slot.full
    if (
        isinstance(grad, DTensor)
        and isinstance(full, DTensor)
        and grad.placements != full.placements
    ):
        grad = grad.redistribute(full.device_mesh, full.placements)
    return _local(grad)


@dataclass
class _Slot:
    """One model parameter and this rank's chunk of it."""

    fqn: str
    full: nn.Parameter
    shard: nn.Parameter
    shard_mesh: DeviceMesh
    """The 1-D mesh of the ranks that split this parameter's state (and all-gather its chunks)."""
    rows_per_rank: int
    row_numel: int
    state_mesh: DeviceMesh
    """Mesh of the chunk-shaped state DTensors: the shard mesh, or (parameter mesh dims...,
    shard mesh) for a DTensor parameter (TP, or EP's experts)."""
    state_placements: tuple[Placement, ...]
    """Their placements: Shard(0), or (the parameter's placements..., Shard(0))."""

    def local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of dim 0 of `tensor` (laid out like the parameter's local tensor)."""
        rows = tensor.shape[0]
        start = min(self.shard_mesh.get_local_rank() * self.rows_per_rank, rows)
        return tensor[start : min(start + self.rows_per_rank, rows)]


class ZeroOneOptimizer(torch.optim.Optimizer):
    """Shard `optimizer`'s state over `mesh` (1-D, the data-parallel ranks); see the module doc.

    `optimizer` must have been built over `model`'s parameters and not stepped yet. The wrapper
    shares the wrapped optimizer's `param_groups` (so LR schedulers work on either) and `state`.
    `param_meshes` maps parameters whose state shards over other ranks than `mesh`'s to their
    own 1-D mesh (expert parallelism: the experts' `edp` ranks). `gather_bucket_numel` bounds
    the all-gathers that rebuild the parameters after the step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        mesh: DeviceMesh,
        param_meshes: Mapping[nn.Parameter, DeviceMesh] | None = None,
        gather_bucket_numel: int = GATHER_BUCKET_NUMEL,
    ):
        if optimizer.state:
            raise ValueError(
                "ZeRO-1 must wrap an optimizer that has not stepped yet; wrap it right after building"
            )
        param_meshes = param_meshes or {}
        for shard_mesh in (mesh, *param_meshes.values()):
            if shard_mesh.ndim != 1:
                raise ValueError(
                    f"ZeRO-1 needs 1-D data-parallel meshes, got {shard_mesh.ndim} dimensions"
                )
        self.inner = optimizer
        self.gather_bucket_numel = gather_bucket_numel
        """Gathered elements of one all-gather after the step at most (`gather_buckets`)."""
        names = {id(p): name for name, p in model.named_parameters()}
        self._state_meshes: dict[tuple[DeviceMesh, DeviceMesh], DeviceMesh] = {}
        self.slots: list[_Slot] = []
        for group in optimizer.param_groups:
            shards = []
            for full in group["params"]:
                if id(full) not in names:
                    raise ValueError(
                        "ZeRO-1: the optimizer holds a parameter that is not in the model"
                    )
                slot = self._make_slot(names[id(full)], full, param_meshes.get(full, mesh))
                self.slots.append(slot)
                shards.append(slot.shard)
            group["params"] = shards
        self._fqn_by_shard = {id(slot.shard): slot.fqn for slot in self.slots}
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.state = optimizer.state

    def _make_slot(self, fqn: str, full: nn.Parameter, shard_mesh: DeviceMesh) -> _Slot:
        if full.dim() == 0:
            raise ValueError(f"ZeRO-1 shards along dim 0; parameter {fqn!r} is a scalar")
        local = _local(full.detach())
        rows = local.shape[0]
        per_rank = math.ceil(rows / shard_mesh.size())
        start = min(shard_mesh.get_local_rank() * per_rank, rows)
        end = min(start + per_rank, rows)
        shard = nn.Parameter(local[start:end], requires_grad=full.requires_grad)
        mesh = shard_mesh
        placements: tuple[Placement, ...] = (Shard(0),)
        if isinstance(full, DTensor):
            mesh = self._state_mesh(full.device_mesh, shard_mesh)
            placements = (*full.placements, Shard(0))
        row_numel = local[0].numel() if rows else 0
        return _Slot(fqn, full, shard, shard_mesh, per_rank, row_numel, mesh, placements)

    def _state_mesh(self, param_mesh: DeviceMesh, shard_mesh: DeviceMesh) -> DeviceMesh:
        """`param_mesh`'s dims then the shard dim, over their existing groups (built once per
        pair).

        The rank grid assumes both meshes are cut from one `init_device_mesh` world mesh, whose
        ranks are affine in the coordinates: rank (i, j) = param_mesh rank i + shard rank j - this
        one (a flattened shard axis is fine: each of its ranks is still such a sum).
        """
        key = (param_mesh, shard_mesh)
        if key not in self._state_meshes:
            names = param_mesh.mesh_dim_names
            shard_names = shard_mesh.mesh_dim_names
            assert names and shard_names and not set(names) & set(shard_names), (
                names,
                shard_names,
            )
            grid = param_mesh.mesh.unsqueeze(-1) + shard_mesh.mesh - dist.get_rank()
            self._state_meshes[key] = DeviceMesh.from_group(
                [*param_mesh.get_all_groups(), shard_mesh.get_group()],
                shard_mesh.device_type,
                mesh=grid,
                mesh_dim_names=(*names, *shard_names),
            )
        return self._state_meshes[key]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step on this rank's chunks with the (all-reduced) gradients, then all-gather parameters."""
        if closure is not None:
            raise ValueError("ZeRO-1 does not support optimizer closures")
        for slot in self.slots:
            grad = slot.full.grad
            slot.shard.grad = None if grad is None else slot.local_rows(_grad_like(grad, slot))
        self.inner.step()
        # The chunks' gradients are views of the full gradients: left set, they would keep every
        # full gradient alive through the next forward and backward (a caller may clear only the
        # model's `.grad`, as PrecisionOptimizer does), one replicated fp32 copy of the model
        # that cancelled the halved optimizer state at the peak (bench/RESULTS.md).
        for slot in self.slots:
            slot.shard.grad = None
        self._all_gather_parameters()
        return None

    def _all_gather_parameters(self) -> None:
        """Rebuild the full parameters: all-gathers per (shard mesh, dtype), in buckets of at
        most `GATHER_BUCKET_NUMEL` gathered elements."""
        groups: dict[tuple[DeviceMesh, torch.dtype], list[_Slot]] = {}
        for slot in self.slots:
            groups.setdefault((slot.shard_mesh, slot.full.dtype), []).append(slot)
        for (shard_mesh, _), members in groups.items():
            world = shard_mesh.size()
            sizes = [world * slot.rows_per_rank * slot.row_numel for slot in members]
            for bucket in gather_buckets(sizes, self.gather_bucket_numel):
                self._all_gather_bucket(shard_mesh, [members[i] for i in bucket])

    @staticmethod
    def _all_gather_bucket(shard_mesh: DeviceMesh, slots: list[_Slot]) -> None:
        """One all-gather of `slots`' chunks, copied into their full parameters."""
        world = shard_mesh.size()
        sizes = [s.rows_per_rank * s.row_numel for s in slots]
        send = slots[0].shard.new_zeros(sum(sizes))
        offset = 0
        for slot, size in zip(slots, sizes, strict=True):
            local = slot.shard.detach().reshape(-1)
            send[offset : offset + local.numel()].copy_(local)
            offset += size
        gathered = send.new_empty(world * send.numel())
        dist.all_gather_single(gathered, send, group=shard_mesh.get_group())
        by_rank = gathered.view(world, -1)
        offset = 0
        for slot, size in zip(slots, sizes, strict=True):
            full = _local(slot.full.detach())
            padded = by_rank[:, offset : offset + size].reshape(
                world * slot.rows_per_rank, *full.shape[1:]
            )
            full.copy_(padded[: full.shape[0]])
            offset += size

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the chunks' and the full parameters' gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)
        for slot in self.slots:
            if set_to_none:
                slot.full.grad = None
            elif slot.full.grad is not None:
                slot.full.grad.zero_()

    def init_state(self) -> None:
        """Materialise the optimizer state (a zero-gradient step at lr 0), e.g. before loading."""
        if self.inner.state:
            return
        saved_lrs = []
        for group in self.param_groups:
            saved_lrs.append(group["lr"])
            group["lr"] = 0.0
        for slot in self.slots:
            slot.shard.grad = torch.zeros_like(slot.shard)
        self.inner.step()
        for group, lr in zip(self.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        self.inner.zero_grad(set_to_none=True)

    def sharded_state_dict(self) -> dict[str, Any]:
        """The state in DCP's flat layout: `state.<fqn>.<key>` and `param_groups.<fqn>.<key>`.

        Chunk-shaped state tensors are DTensors of the parameter's global shape whose local
        tensors alias this optimizer's state (no copy), so loading into them in place restores
        the optimizer: Shard(0) over the DP mesh, or for a tensor-parallel parameter (its TP
        placements, Shard(0)) over the (tp, dp) mesh described in the module doc.
        """
        self.init_state()
        flat: dict[str, Any] = {}
        for slot in self.slots:
            for key, value in self.inner.state[slot.shard].items():
                if isinstance(value, torch.Tensor) and value.shape == slot.shard.shape:
                    value = DTensor.from_local(
                        value,
                        slot.state_mesh,
                        slot.state_placements,
                        run_check=False,
                        shape=slot.full.shape,
                        stride=slot.full.stride(),
                    )
                flat[f"state.{slot.fqn}.{key}"] = value
        for group in self.param_groups:
            for shard in group["params"]:
                fqn = self._fqn_of_shard(shard)
                for key, value in group.items():
                    if key != "params":
                        flat[f"param_groups.{fqn}.{key}"] = value
        return flat

    def load_sharded_state_dict(self, flat: dict[str, Any]) -> None:
        """Apply what `sharded_state_dict` returned after DCP loaded into it in place."""
        for slot in self.slots:
            state = self.inner.state[slot.shard]
            for key in list(state):
                value = flat.get(f"state.{slot.fqn}.{key}")
                if value is None:
                    raise KeyError(f"optimizer state for {slot.fqn!r} lacks {key!r}")
                local = value.to_local() if isinstance(value, DTensor) else value
                if isinstance(local, torch.Tensor) and local.data_ptr() != state[key].data_ptr():
                    state[key].copy_(local)
                elif not isinstance(local, torch.Tensor):
                    state[key] = local
        for group in self.param_groups:
            fqn = self._fqn_of_shard(group["params"][0]) if group["params"] else None
            for key in list(group):
                if key != "params" and f"param_groups.{fqn}.{key}" in flat:
                    group[key] = flat[f"param_groups.{fqn}.{key}"]

    def _fqn_of_shard(self, shard: torch.Tensor) -> str:
        return self._fqn_by_shard[id(shard)]
