"""Served LoRA adapters: reading and checking a peft adapter directory, names and slots.

Shapes: O out features, I in features, r rank.

An adapter is a peft directory (`adapter_config.json` + `adapter_model.safetensors`, as
`PeftModel.save_pretrained` and Meshline's trainer write it). `engine.lora_files.check_adapter_config` reads the
JSON alone (before any weight): plain LoRA, rank within --max-lora-rank, targets this model
serves adapters on. `AdapterSet.prepare` then reads the tensors (off the engine thread: it may
take a while), maps peft's HF module names onto the model's layers and checks every shape;
`install` (on the engine thread, between steps) copies them into a free slot of the model's
`BatchedLora`. A removed adapter's name is gone at once; its slot is reused only once no
request that named it is left.

Each install also gets a prefix-cache namespace (`namespace`): the paged cache chains its
prompt-block digests from it, so the same tokens under two adapters (or under an adapter and
the base model, whose namespace is empty) never share KV blocks. It is drawn from the adapter's
name and a serial number that no later install repeats, so an adapter unloaded and loaded again
(perhaps with other weights) under the same name never meets blocks of its earlier copy.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints.lora import LoraAdapter
from engine.lora_files import MAX_ADAPTER_NAME, check_adapter_config, check_adapter_name
from engine.validation import InvalidRequest, Problem
from models.config import ModelConfig
from models.hf_adapters import from_hf, to_hf
from models.lora_batched import BatchedLora

ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ADAPTER_HEADER_BYTES = 1 << 20
"""Room for an adapter file's header (tensor names, shapes, metadata) beyond its elements."""

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PreparedAdapter:
    """An adapter read and checked against the model, ready to go into a slot."""

    name: str
    """The name requests pick it by (their `model` field)."""
    path: Path
    """The adapter directory it was read from."""
    rank: int
    """peft's `r`."""
    scale: float
    """alpha / r (alpha / sqrt(r) with rsLoRA)."""
    pairs: Pairs
    """Per part module name (`layers.0.self_attn.q_proj`): (A [r, I], B [O, r])."""


class AdapterSet:
    """The adapters one engine serves: their names, slots and the model's `BatchedLora`."""

    def __init__(self, lora: BatchedLora, config: ModelConfig) -> None:
        self.lora = lora
        """The slots in the model's layers."""
        self.model_config = config
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}
        self._paths: dict[str, Path] = {}
        self._namespaces: dict[int, bytes] = {}
        self._installs = itertools.count(1)
        shapes = {
            f"{name}.weight": torch.empty(rows, in_features, device="meta")
            for name, (rows, in_features) in lora.part_shapes().items()
        }
        unfused = config.replace(fused_qkv=False, fused_gate_up=False)
        self.hf_leaves = {k.rsplit(".", 2)[-2] for k in to_hf(shapes, unfused)}
        """HF leaf names (q_proj, ...) of the layers adapters may target."""

    @property
    def max_loras(self) -> int:
        """Adapters held at once (--max-loras)."""
        return self.lora.slots

    @property
    def max_rank(self) -> int:
        """Largest adapter rank (--max-lora-rank)."""
        return self.lora.max_rank

    def names(self) -> dict[str, Path]:
        """Loaded adapters: name -> directory, in load order."""
        with self._lock:
            return dict(self._paths)

    def slot_of(self, name: str) -> int:
        """The slot requests naming `name` use; InvalidRequest (field `model`) when none."""
        with self._lock:
            slot = self._slots.get(name)
            loaded = sorted(self._slots)
        if slot is None:
            raise InvalidRequest(
                [
                    Problem(
                        "model",
                        f"no LoRA adapter {name[:MAX_ADAPTER_NAME]!r} is loaded; "
                        f"loaded adapters: {loaded}",
                    )
                ]
            )
        return slot

    def namespace(self, slot: int) -> bytes:
        """The prefix-cache namespace of the adapter in `slot` (b"" for slot 0, the base model):
        the digest its prompt blocks chain from (see the module doc)."""
        if slot == 0:
            return b""
        with self._lock:
            return self._namespaces[slot]

    def prepare(self, name: str, path: Path, label: str) -> PreparedAdapter:
        """Read adapter directory `path` as `name` and check it fits the model (ValueError
        naming `label` otherwise). Safe to call off the engine thread."""
        check_adapter_name(name, label)
        check_adapter_config(path, self.max_rank, label, self.hf_leaves)
        # An adapter that fits a slot holds at most its elements, at most 8 bytes each (fp64),
        # plus the file's header: a larger file is refused before any byte of it is read.
        limit = 8 * self.lora.adapter_elements() + ADAPTER_HEADER_BYTES
        for file in ADAPTER_WEIGHT_FILES:
            size = (path / file).stat().st_size if (path / file).is_file() else 0
            if size > limit:
                raise ValueError(
                    f"{label}: {file} is {size} bytes, more than an adapter of rank "
                    f"{self.max_rank} on every projection of this model can take ({limit})"
                )
        try:
            adapter = LoraAdapter(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{label}: {exc}") from None
        unfused = self.model_config.replace(fused_qkv=False, fused_gate_up=False)
        pairs: Pairs = {}
        for module, (A_RI, B_OR) in adapter.pairs.items():
            try:
                mapped = from_hf({f"{module}.weight": B_OR}, unfused)
            except (ValueError, RuntimeError) as exc:
                raise ValueError(
                    f"{label}: adapter module {module} fits no layer ({exc})"
                ) from None
            for ours, part_OR in mapped.items():
                pairs[ours.removesuffix(".weight")] = (A_RI, part_OR)
        self.lora.check_pairs(pairs, label)
        rank = max(a.shape[0] for a, _ in pairs.values())
        return PreparedAdapter(name, path, rank, adapter.scale, pairs)

    def install(self, adapter: PreparedAdapter, busy: set[int], label: str) -> int:
        """Put `adapter` into a free slot (one no name holds and no request in `busy` uses);
        returns it. ValueError when the name is taken or every slot is held. Engine thread."""
        with self._lock:
            if adapter.name in self._slots:
                raise ValueError(
                    f"{label}: an adapter named {adapter.name!r} is already loaded; unload it "
                    "first or pick another name"
                )
            held = set(self._slots.values()) | busy
            free = [s for s in range(1, self.lora.slots + 1) if s not in held]
            if not free:
                raise ValueError(
                    f"{label}: all --max-loras {self.lora.slots} adapter slots are in use "
                    f"(loaded: {sorted(self._slots)}, or unloaded ones still running); unload "
                    "one or restart with a larger --max-loras"
                )
            slot = free[0]
            self.lora.write(slot, adapter.pairs, adapter.scale)
            identity = f"lora\0{adapter.name}\0{next(self._installs)}".encode()
            self._namespaces[slot] = hashlib.blake2b(identity, digest_size=16).digest()
            self._slots[adapter.name] = slot
            self._paths[adapter.name] = adapter.path
        return slot

    def remove(self, name: str, label: str) -> None:
        """Forget adapter `name`: new requests naming it are refused; running ones finish with
        it (its slot is reused only after them). ValueError when it is not loaded."""
        with self._lock:
            if name not in self._slots:
                raise ValueError(
                    f"{label}: no LoRA adapter {name[:MAX_ADAPTER_NAME]!r} is loaded; loaded "
                    f"adapters: {sorted(self._slots)}"
                )
            del self._slots[name]
            del self._paths[name]
