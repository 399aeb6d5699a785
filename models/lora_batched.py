"""Many LoRA adapters in one batch: per-row adapter deltas added to a served model's linears.

Shapes: B rows, S positions, I in features, O out features, R rank capacity, L adapter slots.

`BatchedLora` holds, for each adapted linear layer, every loaded adapter stacked in slots:
A [L+1, R, I] and B [L+1, O, R] (slot 0 stays zero: the base model). A forward hook on the layer
adds `B[slot_b] @ (A[slot_b] @ x_b)` to row b's output, the slot of each row coming from
`BatchedLora.rows(index_B)` around the forward. That is the torch form of punica's BGMV
(vLLM's batched LoRA): gather each row's A and B, two batched matmuls. The scale alpha / r is
folded into B when an adapter is written into a slot.

A fused projection (qkv_proj, gate_up_proj) takes one adapter per part (peft trains q/k/v with
their own A): the parts' A stack along R and their B sit block-diagonally, so the rank capacity
of a fused layer is `max_rank` times its parts and each part's delta is exactly its own B·A.

The model's module tree and parameter names are left as they are (hooks, no wrappers): decode
paths built from the plain modules (engine/decode_step.py, native_step.py, CUDA graphs) keep
working for batches without an adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Fused Meshline projections and their parts, in the order their output rows are stacked."""
ADAPTABLE = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj")
ADAPTABLE += ("up_proj", "down_proj")
"""Leaf names of the decoder-layer linears that take served adapters."""


@dataclass(frozen=True)
class LoraTarget:
    """One adaptable linear layer of the served model and how its output rows split."""

    name: str
    """Full module name, e.g. `layers.0.self_attn.qkv_proj`."""
    in_features: int
    """I of the layer."""
    parts: tuple[tuple[str, int, int], ...]
    """(part module name, first output row, rows) per part; one part for an unfused layer."""

    @property
    def out_features(self) -> int:
        """O of the layer."""
        return sum(rows for _, _, rows in self.parts)


def find_targets(model: nn.Module) -> list[LoraTarget]:
    """The adaptable linears of `model` (plain nn.Linear decoder-layer projections)."""
    targets = []
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in ADAPTABLE or type(module) is not nn.Linear:
            continue
        owner = name.rpartition(".")[0]
        if leaf in FUSED_PARTS:
            parts = FUSED_PARTS[leaf]
            sizes = _fused_sizes(model, name, leaf, module.out_features)
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            split = tuple(
                (f"{owner}.{p}", o, n) for p, o, n in zip(parts, offsets, sizes, strict=True)
            )
        else:
            split = ((name, 0, module.out_features),)
        targets.append(LoraTarget(name, module.in_features, split))
    return targets


def _fused_sizes(model: nn.Module, name: str, leaf: str, out: int) -> list[int]:
    """Output rows of each part of fused layer `name` (q/k/v from the attention's sizes)."""
    if leaf == "gate_up_proj":
        return [out // 2, out // 2]
    attention = model.get_submodule(name.rpartition(".")[0])
    q_size, kv_size = attention.q_size, attention.kv_size
    return [q_size, kv_size, kv_size]


class BatchedLora:
    """Adapter slots for every target of one model, applied per row by forward hooks."""

    def __init__(
        self,
        targets: list[LoraTarget],
        slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.targets = {t.name: t for t in targets}
        """Adapted layers by full module name."""
        self.slots = slots
        """Adapters held at once (slot 0, the base model, not counted)."""
        self.max_rank = max_rank
        """Largest rank of one adapter on one (part of a) layer."""
        self.A: dict[str, torch.Tensor] = {}
        """Per layer: A [L+1, R, I] of every slot."""
        self.B: dict[str, torch.Tensor] = {}
        """Per layer: B·scale [L+1, O, R] of every slot."""
        for t in targets:
            capacity = max_rank * len(t.parts)
            self.A[t.name] = torch.zeros(
                slots + 1, capacity, t.in_features, device=device, dtype=dtype
            )
            self.B[t.name] = torch.zeros(
                slots + 1, t.out_features, capacity, device=device, dtype=dtype
            )
        self.index_B: torch.Tensor | None = None
        """Slot of each row of the forward in progress; None: no row has an adapter."""
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def adapter_elements(self) -> int:
        """Elements of the largest adapter one slot holds (A and B of every target at max rank):
        what bounds an adapter file before it is read."""
        return sum(
            a[0].numel() + b[0].numel()
            for a, b in zip(self.A.values(), self.B.values(), strict=True)
        )

    def nbytes(self) -> int:
        """Memory the slots take."""
        return sum(t.numel() * t.element_size() for t in (*self.A.values(), *self.B.values()))

    def attach(self, model: nn.Module) -> None:
        """Hook every target layer of `model` (call once the model's modules are final)."""
        for name in self.targets:
            module = model.get_submodule(name)
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def detach(self) -> None:
        """Remove the hooks (the model computes without adapters again)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor | None]:
        A_LRI, B_LOR = self.A[name], self.B[name]

        def add_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            index_B = self.index_B
            if index_B is None:
                return None
            x = args[0]
            x_BSI = x.reshape(index_B.shape[0], -1, x.shape[-1]).to(A_LRI.dtype)
            h_BSR = torch.bmm(x_BSI, A_LRI[index_B].transpose(1, 2))
            delta_BSO = torch.bmm(h_BSR, B_LOR[index_B].transpose(1, 2))
            return out + delta_BSO.view(out.shape).to(out.dtype)

        return add_delta

    @contextlib.contextmanager
    def rows(self, index_B: torch.Tensor | None) -> Iterator[None]:
        """Within the block, row b of every forward adds slot `index_B[b]`'s delta."""
        self.index_B = index_B
        try:
            yield
        finally:
            self.index_B = None

    @torch.no_grad()
    def write(
        self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float
    ) -> None:
        """Put one adapter into `slot`: `pairs` maps part module names (`layers.0.self_attn.
        q_proj`, or an unfused layer's own name) to (A [r, I], B [rows, r]); parts it does not
        name get zeros. Shapes are the caller's to check (`check_pairs`)."""
        assert 1 <= slot <= self.slots, slot
        for name, t in self.targets.items():
            A_RI, B_OR = self.A[name][slot], self.B[name][slot]
            A_RI.zero_()
            B_OR.zero_()
            for p, (part, first, rows) in enumerate(t.parts):
                if part not in pairs:
                    continue
                a, b = pairs[part]
                r0 = p * self.max_rank
                r = a.shape[0]
                A_RI[r0 : r0 + r].copy_(a)
                B_OR[first : first + rows, r0 : r0 + r].copy_(b.to(torch.float32) * scale)

    def clear(self, slot: int) -> None:
        """Zero `slot` (no row may use it afterwards without a new write)."""
        self.write(slot, {}, 1.0)

    def part_shapes(self) -> dict[str, tuple[int, int]]:
        """(rows, I) of every part module name the slots can hold."""
        return {
            part: (rows, t.in_features) for t in self.targets.values() for part, _, rows in t.parts
        }

    def check_pairs(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], label: str) -> None:
        """ValueError naming the first pair that fits no part, or whose rank/shape is wrong."""
        shapes = self.part_shapes()
        for part, (a, b) in sorted(pairs.items()):
            if part not in shapes:
                raise ValueError(
                    f"{label}: the adapter targets {part}, which is not a linear layer this "
                    f"model serves adapters on (decoder-layer projections {list(ADAPTABLE)})"
                )
            rows, in_features = shapes[part]
            r = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
                raise ValueError(f"{label}: {part} has A {tuple(a.shape)} and B {tuple(b.shape)}")
            if r > self.max_rank:
                raise ValueError(
                    f"{label}: {part} has rank {r}, over --max-lora-rank {self.max_rank}; "
                    "restart the server with a larger --max-lora-rank"
                )
            if a.shape[1] != in_features or b.shape[0] != rows:
                raise ValueError(
                    f"{label}: {part} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the "
                    f"model's layer is {rows}x{in_features}: the adapter was trained on another "
                    "model"
                )
