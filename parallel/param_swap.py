"""ZeRO-3 parameters on the NVMe tier (DeepSpeed ZeRO-Infinity's `offload_param.device: nvme`).

Under FSDP2 (ZeRO-3, `--cpu-offload`) each rank keeps, per parameter, a padded flat fp32 shard
on the host (`FSDPParam._sharded_param_data`) and the DTensor parameter's local tensor is a view
of it. `ParamSwap` moves those shards into one swap file per rank (`SwapFile`: created in the
opened `nvme_path`, unlinked at once), laid out group by group in FSDP's order (the root's group,
then each decoder layer's), each group's shards back to back, so one group is one `preadv`.

Between uses the shard tensors are views of a shared mapping of that file: untouched pages are
not in the resident set, and whatever reads or writes parameters at rest (a checkpoint save or
load, `load_state_dict`) goes through the mapping to the file. For a group's all-gather the
shards are read (`preadv` on an I/O thread, which releases the GIL) into one of `buffer_count`
host buffers, the shard tensors point into the buffer for FSDP's all-gather copy-in, and they
point back at the mapping as soon as the gather has its copy: reading into a buffer rather than
touching the mapping keeps the pages out of the process (a touched mapping stays resident until
it is dropped) and lets the reads of the next groups (up to `buffer_count - 1`) run while this
one computes. The next groups are predicted from the order the first training step gathered in
(forward, then backward in reverse, per micro-batch), which repeats every step; a wrong guess
only costs the read. Host memory of the tier: `buffer_count` x the largest group's shards.

The optimizer (`OffloadAdamW` with a `ParamSwap`) steps the shards chunk by chunk from the file
(`locate`) and writes them back; it calls `end_step` first (prefetched buffers hold the
pre-step values) and `rebind` after, which drops the mapping's touched pages.

Needs at least two ranks in the shard group: with one, FSDP2 uses the shard itself as the
unsharded parameter (no all-gather copy), so it cannot leave memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from kernels import device
from models.model_states import PARAM_SWAP_BUFFER_COUNT
from parallel.nvme_swap import SwapDirectory, SwapFile


@dataclass
class _Group:
    """One FSDP parameter group's shards in the swap file."""

    group: object
    """The `FSDPParamGroup`."""
    params: list[object]
    """Its `FSDPParam`s, in file order."""
    offset: int
    """File offset (elements) of its first shard."""
    numel: int
    """Elements of all its padded shards."""


def _param_groups(model: nn.Module) -> list[object]:
    """FSDP2's parameter groups of `model`, in module order (the root's first)."""
    groups: list[object] = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:
            single = getattr(state, "_fsdp_param_group", None)
            found = [single] if single is not None else []
        groups.extend(found)
    return groups


class ParamSwap:
    """The parameter shards of an FSDP2-sharded `model` in a swap file below `folder`."""

    def __init__(
        self, model: nn.Module, folder: SwapDirectory, buffer_count: int = PARAM_SWAP_BUFFER_COUNT
    ) -> None:
        try:
            self._create(model, folder, buffer_count)
        finally:
            folder.close()  # the file is open and unlinked (or failed): the folder is not needed
        self.buffer_count = buffer_count
        """Host buffers a gather reads into (the current group and read-ahead)."""
        self._buffer_numel = max(entry.numel for entry in self._groups)
        self._free = [torch.empty(self._buffer_numel) for _ in range(buffer_count)]
        self._pool = ThreadPoolExecutor(1, "param-swap")
        self._pending: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self._order: list[int] = []
        self._recording = True
        self._cursor = 0
        self.gathers = 0
        """Groups read in for an all-gather so far."""
        self.read_ahead_hits = 0
        """Of those, groups whose read was started ahead (predicted) and used."""
        self.rebind()  # the original shards are dropped here: the file holds them now
        for index, entry in enumerate(self._groups):
            self._wrap(index, entry.group)
        # A load (DCP, `load_state_dict`) writes the file through the mapping: reads started
        # before it hold the old values.
        model.register_load_state_dict_post_hook(lambda *_: self._discard_read_ahead())

    def _create(self, model: nn.Module, folder: SwapDirectory, buffer_count: int) -> None:
        """Check the model's groups, lay them out, and write their shards to a new file."""
        if buffer_count < 1:
            raise ValueError(f"--param-nvme-buffer-count must be >= 1, got {buffer_count}")
        found = _param_groups(model)
        if not found:
            raise ValueError(
                "--param-nvme-path needs ZeRO-3 sharded parameters (--zero-stage 3 over 2 or more "
                "data-parallel ranks): the model has no FSDP parameter groups"
            )
        self._groups: list[_Group] = []
        self._where: dict[int, tuple[object, int]] = {}
        offset = 0
        for group in found:
            if group.mesh_info.shard_mesh_size < 2:  # type: ignore[attr-defined]
                raise ValueError(
                    "--param-nvme-path needs a shard group of 2 or more data-parallel ranks (with "
                    "one, FSDP computes with the shard itself, which cannot leave memory)"
                )
            params = list(group.fsdp_params)  # type: ignore[attr-defined]
            start = offset
            for fsdp_param in params:
                # Adopt a local tensor given after sharding (`to_empty` of a meta model), as FSDP2
                # does at its lazy init; a no-op otherwise.
                fsdp_param.reset_sharded_param()
                data = fsdp_param._sharded_param_data
                if (
                    fsdp_param.fsdp_placement.dim != 0
                    or not fsdp_param.offload_to_cpu
                    or data.dtype != torch.float32
                ):
                    raise ValueError(
                        "--param-nvme-path needs fp32 dim-0 shards on the host (--cpu-offload, "
                        f"FSDP2's default Shard(0)); got {data.dtype} shards on "
                        f"dim {fsdp_param.fsdp_placement.dim}"
                    )
                self._where[id(fsdp_param.sharded_param)] = (fsdp_param, offset)
                offset += fsdp_param._sharded_param_data.numel()
            self._groups.append(_Group(group, params, start, offset - start))
        self.numel = offset
        """Elements in the swap file (every padded shard of this rank)."""
        self.file = SwapFile(folder, "params", offset)
        """The rank's parameter swap file."""
        for entry in self._groups:
            for fsdp_param in entry.params:
                _, at = self._where[id(fsdp_param.sharded_param)]
                self.file.write(fsdp_param._sharded_param_data.detach().contiguous(), at)

    # -- at rest ----------------------------------------------------------------------------
    def rebind(self) -> None:
        """Point every shard at a fresh mapping of the file (drops the pages touched so far)."""
        self._mapping = self.file.mapping()
        for entry in self._groups:
            self._point(entry, self._mapping, entry.offset)

    @staticmethod
    def _point(entry: _Group, storage: torch.Tensor, base: int) -> None:
        """Make `entry`'s shard tensors views of 1-D `storage` from element `base`."""
        at = base
        for fsdp_param in entry.params:
            numel = fsdp_param._sharded_param_data.numel()  # type: ignore[attr-defined]
            flat = storage[at : at + numel]
            padded = flat.view(fsdp_param.padded_sharded_param_size)  # type: ignore[attr-defined]
            rows = fsdp_param.sharded_size[0] if len(fsdp_param.sharded_size) else 0  # type: ignore[attr-defined]
            fsdp_param._sharded_param_data = flat  # type: ignore[attr-defined]
            fsdp_param.sharded_param._local_tensor = padded.narrow(0, 0, rows)  # type: ignore[attr-defined]
            at += numel

    def locate(self, param: torch.Tensor) -> int | None:
        """The file offset (elements) of `param`'s local shard, or None if not in this tier."""
        found = self._where.get(id(param))
        return None if found is None else found[1]

    def buffer_bytes(self) -> int:
        """Bytes of the tier's host buffers (the most a gather holds)."""
        return self.buffer_count * self._buffer_numel * 4

    def end_step(self) -> None:
        """Before the optimizer writes the file: drop read-ahead buffers (they hold the old
        values) and, after the first step, predict gathers from the order it recorded."""
        self._discard_read_ahead()
        self._recording = False
        self._cursor = 0

    def _discard_read_ahead(self) -> None:
        """Wait for the reads started ahead and return their buffers unused."""
        for buffer, pending in self._pending.values():
            pending.result()
            self._free.append(buffer)
        self._pending.clear()

    # -- gathers ----------------------------------------------------------------------------
    def _wrap(self, index: int, group: object) -> None:
        """Route `group.unshard` through the file: shards read in before, released after."""
        unshard = group.unshard  # type: ignore[attr-defined]
        entry = self._groups[index]

        def unshard_from_file(async_op: bool = False) -> None:
            if group._all_gather_result is not None or group.is_unsharded:  # type: ignore[attr-defined]
                unshard(async_op)  # FSDP's no-op: nothing is gathered
                return
            buffer = self._load(index)
            try:
                unshard(async_op)
                if device.current().type != "cpu":
                    device.synchronize()  # a non-blocking host-to-device copy may still read it
            finally:
                # The gather has copied the shards in: they return to the file.
                self._point(entry, self._mapping, entry.offset)
                self._free.append(buffer)
            self._read_ahead(index)

        group.unshard = unshard_from_file  # type: ignore[attr-defined]

    def _take(self) -> torch.Tensor:
        """A free buffer; a read-ahead one is reclaimed when none is free."""
        if not self._free:
            index = next(iter(self._pending))
            buffer, pending = self._pending.pop(index)
            pending.result()
            return buffer
        return self._free.pop()

    def _load(self, index: int) -> torch.Tensor:
        """Group `index`'s shards in a buffer (read ahead, or read now); returns the buffer."""
        entry = self._groups[index]
        if self._recording:
            self._order.append(index)
        ahead = self._pending.pop(index, None)
        self.gathers += 1
        if ahead is not None:
            buffer, pending = ahead
            pending.result()
            self.read_ahead_hits += 1
        else:
            buffer = self._take()
            self.file.read(buffer[: entry.numel], entry.offset)
        self._point(entry, buffer, 0)
        return buffer

    def _read_ahead(self, index: int) -> None:
        """Start reading the groups predicted to gather after `index` (recorded order)."""
        if self._recording:
            return
        order = self._order
        if self._cursor < len(order) and order[self._cursor] == index:
            self._cursor += 1
        elif index in order[self._cursor :]:  # resynchronise after an unpredicted gather
            self._cursor = order.index(index, self._cursor) + 1
        else:
            return
        # Up to buffer_count - 1 groups ahead: one buffer stays free for an unpredicted gather.
        for upcoming in order[self._cursor : self._cursor + self.buffer_count - 1]:
            if upcoming in self._pending:
                continue
            if not self._free:
                return
            entry, buffer = self._groups[upcoming], self._free.pop()
            self._pending[upcoming] = (
                buffer,
                self._pool.submit(self.file.read, buffer[: entry.numel], entry.offset),
            )

    def close(self) -> None:
        """Stop the I/O thread and close the file (the parameters are gone afterwards)."""
        for _, pending in self._pending.values():
            pending.result()
        self._pending.clear()
        self._pool.shutdown()
        self.file.close()
