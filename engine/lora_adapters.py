"""Served LoRA adapters: reading and checking a peft adapter directory, names and slots.

Shapes: O out features, I in features, r rank.

An adapter is a peft directory (`adapter_config.json` + `adapter_model.safetensors`, as
`PeftModel.save_pretrained` and Meshline's trainer write it). `check_adapter_config` reads the
JSON alone (before any weight): plain LoRA, rank within --max-lora-rank, targets this model
serves adapters on. `AdapterSet.prepare` then reads the tensors (off the engine thread: it may
take a while), maps peft's HF module names onto the model's layers and checks every shape;
`install` (on the engine thread, between steps) copies them into a free slot of the model's
`BatchedLora`. A removed adapter's name is gone at once; its slot is reused only once no
request that named it is left.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints.lora import LoraAdapter
from engine.validation import InvalidRequest, Problem
from models.config import ModelConfig
from models.hf_adapters import from_hf, to_hf
from models.lora_batched import BatchedLora

MAX_ADAPTER_NAME = 128
"""Longest adapter name (a request's `model` field)."""
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


def check_adapter_name(name: str, label: str) -> None:
    """ValueError unless `name` is a usable adapter name (printable, no spaces, bounded)."""
    if not name or len(name) > MAX_ADAPTER_NAME or not name.isprintable() or " " in name:
        raise ValueError(
            f"{label}: adapter name {name[:MAX_ADAPTER_NAME]!r} must be 1 to {MAX_ADAPTER_NAME} "
            "printable characters without spaces"
        )


def check_adapter_config(
    path: Path, max_rank: int, label: str, hf_leaves: set[str] | None = None
) -> dict[str, Any]:
    """adapter_config.json of adapter directory `path`, or ValueError naming what is wrong:
    not a plain-LoRA peft directory, a rank over `max_rank`, a target outside `hf_leaves` (HF
    leaf names of the layers that take adapters; None: not checked). Reads no weight."""
    if not path.is_dir():
        raise ValueError(f"{label}: {str(path)!r} is not an existing adapter directory")
    config_path = path / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{label}: {config_path} is missing; give a peft LoRA adapter directory "
            "(PeftModel.save_pretrained, or a Meshline LoRA training output)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{label}: {config_path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{label}: {config_path} holds no JSON object")
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"{label}: only plain LoRA adapters are served (peft_type LORA, no DoRA)")
    refused = {
        "modules_to_save": "whole modules replaced per adapter; merge it with --lora-load",
        "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas",
        "fan_in_fan_out": "transposed (Conv1D) layers",
    }
    for key, why in refused.items():
        if config.get(key):
            raise ValueError(f"{label}: {config_path} sets {key} ({why}), which is not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{label}: {config_path} trains biases (bias {config['bias']!r})")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{label}: {config_path} has rank r={r!r}; expected a positive integer")
    if r > max_rank:
        raise ValueError(
            f"{label}: the adapter's rank {r} is over --max-lora-rank {max_rank}; restart the "
            f"server with --max-lora-rank {r} or more"
        )
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"{label}: {config_path} has lora_alpha={alpha!r}; expected > 0")
    targets = config.get("target_modules")
    if hf_leaves is not None and isinstance(targets, list):
        outside = sorted({str(t).rpartition(".")[2] for t in targets} - hf_leaves)
        if outside:
            raise ValueError(
                f"{label}: the adapter targets {outside}, which this model does not serve "
                f"adapters on; its adaptable layers are {sorted(hf_leaves)}"
            )
    return config


class AdapterSet:
    """The adapters one engine serves: their names, slots and the model's `BatchedLora`."""

    def __init__(self, lora: BatchedLora, config: ModelConfig) -> None:
        self.lora = lora
        """The slots in the model's layers."""
        self.model_config = config
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}
        self._paths: dict[str, Path] = {}
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

    def prepare(self, name: str, path: Path, label: str) -> PreparedAdapter:
        """Read adapter directory `path` as `name` and check it fits the model (ValueError
        naming `label` otherwise). Safe to call off the engine thread."""
        check_adapter_name(name, label)
        check_adapter_config(path, self.max_rank, label, self.hf_leaves)
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
