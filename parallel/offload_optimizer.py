"""The offloaded optimizer of ZeRO-Offload / ZeRO-Infinity: AdamW stepped on the CPU with its
states on the host (`device="cpu"`) or in swap files on local disk (`device="nvme"`).

DeepSpeed's `DeepSpeedCPUAdam` is one vectorised pass over fp32 params, grads, m and v; torch's
fused CPU AdamW kernel (`torch._fused_adamw_`) is that pass, so it is what steps here (on a
2-core EPYC it is ~3x faster than `torch.optim.AdamW(foreach=True)`, bench/RESULTS.md; a C
kernel of our own would redo it). Results equal `torch.optim.AdamW(fused=True)` bit for bit.

Where a parameter lives (`to_local()` for DTensors: ZeRO-2/3 shards, ZeRO-1 chunks):

| parameter          | tier | the step                                                          |
| ------------------ | ---- | ----------------------------------------------------------------- |
| host, fp32         | cpu  | one fused call per group, in place (m, v in host memory)          |
| host, fp32         | nvme | chunks: m, v read from disk ahead, stepped, written back behind   |
| accelerator / bf16 | any  | chunks: p, g copied to fp32 host buffers, stepped, p copied back  |
| NVMe parameter tier| any  | chunks: p read from the tier's file ahead (with m, v for nvme),   |
|                    |      | stepped, written back behind (`param_swap`, --param-nvme-path)    |

So on an accelerator the device keeps only the fp32 parameters and gradients; m and v (8 bytes
a parameter) and the arithmetic move to the host, and with `nvme` off the host into files. The
chunks stream through `buffer_count` buffers of `buffer_numel` elements: reads of the next
chunks and the write of the previous one run on a thread pool while a chunk is stepped, and the
host holds at most those buffers. `pin_memory` pins the staging buffers where a device exists
(faster device copies); a CPU-only run has no device copies to speed up (docs/decisions.md).

State keys and layout are torch AdamW's (`step`, `exp_avg`, `exp_avg_sq`, DTensors for DTensor
parameters), so checkpoints move between this optimizer and torch's; under `nvme` the tensors
`state_dict` returns map the swap files, so a save reads them from disk and a load writes them
back there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from kernels import device
from models.model_states import OFFLOAD_BUFFER_COUNT, OFFLOAD_BUFFER_NUMEL
from parallel.nvme_swap import SwapDirectory, SwapFile
from parallel.param_swap import ParamSwap

OFFLOAD_DEVICES = ("cpu", "nvme")
STATE_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class OptimizerOffload:
    """Where the optimizer states and step live (DeepSpeed's `offload_optimizer` block)."""

    device: str = "cpu"
    """"cpu": host memory; "nvme": swap files below `nvme_path`."""
    nvme_path: str | None = None
    """Directory for the swap files (device "nvme"); inside the data roots, no symlinks."""
    pin_memory: bool = False
    """Pin the host staging buffers (only where parameters live on an accelerator)."""
    buffer_numel: int = OFFLOAD_BUFFER_NUMEL
    """Elements per staging/swap buffer (DeepSpeed's `buffer_size`)."""
    buffer_count: int = OFFLOAD_BUFFER_COUNT
    """Buffers in flight: one being stepped, the others read ahead / written behind (>= 2)."""
    io_threads: int = 2
    """Threads doing the swap-file reads and writes."""

    def __post_init__(self) -> None:
        if self.device not in OFFLOAD_DEVICES:
            raise ValueError(
                f"optimizer offload device must be one of {OFFLOAD_DEVICES}, got {self.device!r}"
            )
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("optimizer offload to nvme needs nvme_path (a local directory)")
        if self.buffer_numel < 1 or self.buffer_count < 2 or self.io_threads < 1:
            raise ValueError(
                "optimizer offload needs buffer_numel >= 1, buffer_count >= 2 and io_threads >= 1, "
                f"got {self.buffer_numel}, {self.buffer_count}, {self.io_threads}"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` wrapped as `param` is: a DTensor with its mesh and placements, or as is."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


@dataclass
class _Chunk:
    """Elements [start, end) of one parameter's local tensor."""

    param: torch.Tensor
    start: int
    end: int
    file_offset: int
    param_offset: int | None = None
    """Where the parameter's elements sit in the parameter tier's file (None: in memory)."""


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, no amsgrad) stepped on the CPU; see the module doc.

    The nvme tier creates its swap files in `swap_dir` (`offload.nvme_path` opened by the
    caller) at the first step, and closes the directory then.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        offload: OptimizerOffload,
        swap_dir: SwapDirectory | None = None,
        param_swap: ParamSwap | None = None,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        if (swap_dir is None) != (offload.device != "nvme"):
            raise ValueError("the nvme tier needs swap_dir (nvme_path opened), the cpu tier none")
        self.offload = offload
        """The tier settings."""
        self._swap_dir = swap_dir
        self._param_swap = param_swap
        self._swaps: dict[str, SwapFile] = {}
        self._offsets: dict[torch.Tensor, int] = {}
        self._buffers: list[dict[str, torch.Tensor]] = []
        self._pool: ThreadPoolExecutor | None = None

    # -- state ------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _init_state(self) -> None:
        """Create every parameter's state (zeros, step 0) in the tier, once."""
        if self._offsets:
            return
        offset = 0
        for p in self._params():
            self._offsets[p] = offset
            offset += _local(p).numel()
            self.state[p]["step"] = torch.tensor(0.0)
        if self._swap_dir is not None:
            for key in STATE_KEYS:
                self._swaps[key] = SwapFile(self._swap_dir, key, offset)
            self._swap_dir.close()  # the files are open and unlinked: the folder is not needed
            self._bind_views()
        else:
            for p in self._params():
                local = _local(p)
                for key in STATE_KEYS:
                    zeros = torch.zeros(local.shape, dtype=torch.float32, device="cpu")
                    self.state[p][key] = _like(zeros, p)

    def _bind_views(self) -> None:
        """Point the nvme tier's state tensors at fresh mappings of the swap files.

        A fresh mapping has no page loaded: whatever a checkpoint save or load touched through
        the previous one leaves the resident set once that mapping is dropped.
        """
        maps = {key: swap.mapping() for key, swap in self._swaps.items()}
        for p, offset in self._offsets.items():
            local = _local(p)
            for key in STATE_KEYS:
                view = maps[key][offset : offset + local.numel()].view(local.shape)
                self.state[p][key] = _like(view, p)

    def state_bytes_in_memory(self) -> int:
        """Bytes of optimizer state held in host memory (0 for the nvme tier's swap files)."""
        if self.offload.device == "nvme":
            return 0
        return sum(
            _local(s[key]).numel() * 4
            for s in self.state.values()
            for key in STATE_KEYS
            if key in s
        )

    def buffer_bytes(self) -> int:
        """Bytes of the staging and swap buffers allocated so far (what the chunked step holds)."""
        return sum(t.numel() * t.element_size() for slot in self._buffers for t in slot.values())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore torch AdamW's `state_dict` layout into this tier (files for nvme)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"])
            for s, g in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "optimizer state does not match this optimizer's parameter groups "
                f"({[len(s['params']) for s in saved_groups]} saved, "
                f"{[len(g['params']) for g in self.param_groups]} here)"
            )
        self._init_state()
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            for index, p in zip(saved["params"], group["params"], strict=True):
                entry = state_dict["state"].get(index)
                if entry is not None:
                    self._store(p, entry)
        if self._swaps:
            self._bind_views()

    def _store(self, p: torch.Tensor, entry: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] = torch.tensor(float(entry["step"]))
        for key in STATE_KEYS:
            source = _local(entry[key]).detach()
            current = _local(state[key])
            if source.data_ptr() == current.data_ptr():
                continue  # loaded in place (DCP fills the tensors state_dict returned)
            if key in self._swaps:
                host = source.to("cpu", torch.float32).contiguous().view(-1)
                self._swaps[key].write(host, self._offsets[p])
            else:
                current.copy_(source)

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._init_state()
        if self._param_swap is not None:
            self._param_swap.end_step()
        for group in self.param_groups:
            stepped = [p for p in group["params"] if p.grad is not None]
            for p in stepped:
                self.state[p]["step"] += 1
            direct = [p for p in stepped if _on_host(_local(p)) and _on_host(_local(p.grad))]
            if self._io() or len(direct) != len(stepped):
                self._step_chunks(group, stepped)
            elif direct:
                self._fused(group, direct, [_local(p.grad) for p in direct], None)
        if self._param_swap is not None:
            self._param_swap.rebind()  # drop any page of the tier a save or load touched
        return loss

    def _io(self) -> bool:
        """Whether the step streams through files (states or parameters on the NVMe tier)."""
        return bool(self._swaps) or self._param_swap is not None

    def _fused(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        moments: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
        steps: list[torch.Tensor] | None = None,
    ) -> None:
        if moments is None:
            moments = (
                [_local(self.state[p]["exp_avg"]) for p in params],
                [_local(self.state[p]["exp_avg_sq"]) for p in params],
            )
            steps = [self.state[p]["step"] for p in params]
            params = [_local(p) for p in params]
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params,
            grads,
            moments[0],
            moments[1],
            [],
            steps,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )

    def _chunks(self, params: list[torch.Tensor]) -> list[_Chunk]:
        size = self.offload.buffer_numel
        tier = self._param_swap
        chunks = []
        for p in params:
            base = tier.locate(p) if tier is not None else None
            for start in range(0, _local(p).numel(), size):
                end = min(start + size, _local(p).numel())
                at = None if base is None else base + start
                chunks.append(_Chunk(p, start, end, self._offsets[p] + start, at))
        return chunks

    def _buffer(self, slot: int, name: str, numel: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append({})
        buffers = self._buffers[slot]
        if name not in buffers:
            pin = self.offload.pin_memory and device.current().type != "cpu"
            buffers[name] = torch.empty(self.offload.buffer_numel, pin_memory=pin)
        return buffers[name][:numel]

    def _step_chunks(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Step `params` chunk by chunk, reading the next chunks' m and v ahead and writing the
        previous chunk's behind on the I/O threads (nvme), staging non-host parameters."""
        chunks = self._chunks(params)
        slots = self.offload.buffer_count
        if self._io() and self._pool is None:
            self._pool = ThreadPoolExecutor(self.offload.io_threads, "nvme-swap")
        reads: dict[int, list[Future[None]]] = {}
        writes: list[list[Future[None]]] = [[] for _ in range(slots)]

        def read_ahead(index: int) -> None:
            slot, chunk = index % slots, chunks[index]
            for pending in writes[slot]:
                pending.result()  # the slot's buffers are free once its write is done
            writes[slot] = []
            numel = chunk.end - chunk.start
            assert self._pool is not None
            reads[index] = [
                self._pool.submit(swap.read, self._buffer(slot, key, numel), chunk.file_offset)
                for key, swap in self._swaps.items()
            ]
            if chunk.param_offset is not None:
                read = self._param_file().read
                into = self._buffer(slot, "param", numel)
                reads[index].append(self._pool.submit(read, into, chunk.param_offset))

        if self._io():
            for index in range(min(slots - 1, len(chunks))):
                read_ahead(index)
        for index, chunk in enumerate(chunks):
            slot, numel = index % slots, chunk.end - chunk.start
            for pending in reads.pop(index, []):
                pending.result()
            self._step_one(group, chunk, slot, numel)
            if self._io():
                assert self._pool is not None
                writes[slot] = [
                    self._pool.submit(swap.write, self._buffer(slot, key, numel), chunk.file_offset)
                    for key, swap in self._swaps.items()
                ]
                if chunk.param_offset is not None:
                    write, stepped = self._param_file().write, self._buffer(slot, "param", numel)
                    writes[slot].append(self._pool.submit(write, stepped, chunk.param_offset))
                if index + slots - 1 < len(chunks):
                    read_ahead(index + slots - 1)
        for pending_writes in writes:
            for pending in pending_writes:
                pending.result()
        if self._swaps:
            self._bind_views()

    def _param_file(self) -> SwapFile:
        assert self._param_swap is not None
        return self._param_swap.file

    def _step_one(self, group: dict[str, Any], chunk: _Chunk, slot: int, numel: int) -> None:
        p, start, end = chunk.param, chunk.start, chunk.end
        grad = _local(p.grad).reshape(-1)[start:end]
        step = [self.state[p]["step"]]
        if chunk.param_offset is not None:
            # The parameter tier's chunk was read into the slot; it is written back behind.
            host_p, host_g = self._buffer(slot, "param", numel), grad
            if not _on_host(grad):
                host_g = self._buffer(slot, "grad", numel)
                host_g.copy_(grad)
            self._fused(group, [host_p], [host_g], self._moments(p, slot, start, end), step)
            return
        local = _local(p).view(-1)[start:end]
        staged = not (_on_host(local) and _on_host(grad))
        host_p, host_g = local, grad
        if staged:
            host_p = self._buffer(slot, "param", numel)
            host_g = self._buffer(slot, "grad", numel)
            host_p.copy_(local)
            host_g.copy_(grad)
        self._fused(group, [host_p], [host_g], self._moments(p, slot, start, end), step)
        if staged:
            local.copy_(host_p)

    def _moments(
        self, p: torch.Tensor, slot: int, start: int, end: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """m and v of elements [start, end) of `p`: the slot's buffers (nvme) or the states."""
        if self._swaps:
            numel = end - start
            m, v = self._buffer(slot, "exp_avg", numel), self._buffer(slot, "exp_avg_sq", numel)
        else:
            m = _local(self.state[p]["exp_avg"]).view(-1)[start:end]
            v = _local(self.state[p]["exp_avg_sq"]).view(-1)[start:end]
        return [m], [v]

    def close(self) -> None:
        """Stop the I/O threads and drop the swap files (the state is gone afterwards)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for swap in self._swaps.values():
            swap.close()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self.close()
