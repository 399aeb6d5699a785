"""LoRA: low-rank adapters on linear layers, with peft's math and parameter names.

Shapes: N tokens (any leading dims), I in features, O out features, R rank.

`apply_lora(model, LoraConfig(...))` turns each targeted `nn.Linear` into a `LoraLinear` in
place: the base `weight`/`bias` keep their names (`layers.0.self_attn.qkv_proj.weight`) and stay
frozen, and the module gains `lora_A` (I→R, Kaiming-uniform like peft) and `lora_B` (R→O, zeros)
so that `y = W x + b + B(A(dropout(x))) · alpha / r`. Targets take Meshline's module names and
ModelLink/Megatron's (`query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`, `W_pack`),
resolved against the modules the model actually has (fused or separate projections). The
peft-format import/export lives in `models/lora_io.py`.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# ModelLink / Megatron / HF spellings → Meshline leaf names (each mapped onto what exists).
TARGET_ALIASES: dict[str, tuple[str, ...]] = {
    "query_key_value": ("qkv_proj", "q_proj", "k_proj", "v_proj"),
    "W_pack": ("qkv_proj", "q_proj", "k_proj", "v_proj"),
    "dense": ("o_proj",),
    "dense_h_to_4h": ("gate_up_proj", "gate_proj", "up_proj"),
    "dense_4h_to_h": ("down_proj",),
}
LINEAR_NAMES = (
    "qkv_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_up_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)
# Megatron/ModelLink names of modules for --lora-modules-to-save -> Meshline leaf names.
MODULE_ALIASES: dict[str, str] = {
    "word_embeddings": "embed_tokens",
    "output_layer": "lm_head",
    "final_layernorm": "norm",
}
# A target naming part of a fused projection, and the fused module that holds it.
_FUSED_PARTS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


@dataclass
class LoraConfig:
    """Which linear layers get adapters, and the adapters' rank, scale and dropout."""

    r: int = 8
    """Rank R of each adapter (--lora-r)."""
    alpha: float = 16.0
    """Scale numerator: the adapter output is multiplied by alpha / r (--lora-alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (--lora-dropout)."""
    target_modules: list[str] = field(default_factory=lambda: ["qkv_proj", "o_proj"])
    """Module leaf names or ModelLink aliases to adapt (--lora-target-modules)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full and saved with the adapters, e.g. lm_head (--lora-modules-to-save)."""

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"--lora-r must be a positive integer, got {self.r!r}")
        if self.alpha <= 0:
            raise ValueError(f"--lora-alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError("--lora-target-modules is empty; name at least one linear layer")
        self.modules_to_save = [MODULE_ALIASES.get(m, m) for m in self.modules_to_save]
        known = set(LINEAR_NAMES) | set(TARGET_ALIASES)
        unknown = [t for t in self.target_modules if t not in known]
        if unknown:
            raise ValueError(
                f"--lora-target-modules {unknown}: unknown module name(s); use Meshline names "
                f"{list(LINEAR_NAMES)} or aliases {list(TARGET_ALIASES)}"
            )

    @property
    def scaling(self) -> float:
        """alpha / r, the factor on the adapter's output (peft's non-rslora scaling)."""
        return self.alpha / self.r


class LoraLinear(nn.Linear):
    """A frozen `nn.Linear` plus a trainable low-rank update B·A scaled by alpha / r."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=dev, dtype=dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=dev, dtype=dtype)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.scaling = r, alpha / r
        self.adapter_enabled = True
        """False inside `adapters_disabled`: the layer computes with its base weight only."""
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """peft's init: A ~ Kaiming-uniform(a=√5), B = 0 (the adapted layer starts unchanged)."""
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) on a [R, I] matrix
        self.lora_A.weight.uniform_(-bound, bound, generator=generator)
        self.lora_B.weight.zero_()

    def forward(self, x_NI: torch.Tensor) -> torch.Tensor:
        """W x + b + B(A(dropout(x))) · scaling."""
        out_NO = F.linear(x_NI, self.weight, self.bias)
        if not self.adapter_enabled:
            return out_NO
        x_NI = x_NI.to(self.lora_A.weight.dtype)
        return out_NO + self.lora_B(self.lora_A(self.lora_dropout(x_NI))) * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + B·A·scaling: the plain weight this layer computes with (for merging/export)."""
        delta_OI = self.lora_B.weight.float() @ self.lora_A.weight.float() * self.scaling
        return (self.weight.float() + delta_OI).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling}"


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base: every `LoraLinear` skips its adapter inside the block
    (peft's `disable_adapter`; DPO's reference for a LoRA policy is the base this way)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True


def resolve_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """Full names of the `nn.Linear` modules `targets` select (aliases mapped onto what exists).

    A target naming part of a fused projection (q_proj on a model with qkv_proj) is an error:
    one adapter on the fused layer is not the same update as one on a part.
    """
    present = {
        name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }
    leaves = {name.rpartition(".")[2] for name in present}
    wanted: set[str] = set()
    # Parts of a fused projection (HF's q_proj ... up_proj, ModelLink's gate_proj beside
    # dense_h_to_4h) select it when every part, or the fused module itself, is targeted.
    fused_targets = _fused_targets(targets, leaves)
    for target in targets:
        if target in _FUSED_PARTS and _FUSED_PARTS[target] in fused_targets:
            wanted.add(_FUSED_PARTS[target])
            continue
        if target in TARGET_ALIASES:
            hits = [leaf for leaf in TARGET_ALIASES[target] if leaf in leaves]
            # The fused module wins over its parts when both spellings could apply.
            wanted.update(hits[:1] if hits and hits[0] in ("qkv_proj", "gate_up_proj") else hits)
        elif target in leaves:
            wanted.add(target)
        elif target in _FUSED_PARTS and _FUSED_PARTS[target] in leaves:
            raise ValueError(
                f"--lora-target-modules {target}: this model fuses it into "
                f"{_FUSED_PARTS[target]}; target {_FUSED_PARTS[target]} (or its alias) instead, or "
                "build the model unfused (fused_qkv=False / fused_gate_up=False)"
            )
    names = sorted(n for n in present if n.rpartition(".")[2] in wanted and "lora_" not in n)
    if not names:
        raise ValueError(
            f"--lora-target-modules {targets}: no linear layer of this model matches; its linear "
            f"layers are {sorted(leaves - {'lora_A', 'lora_B'})}"
        )
    return names


def _fused_targets(targets: list[str], leaves: set[str]) -> set[str]:
    """Fused modules of the model that `targets` select as a whole (by name, alias or all parts)."""
    out = set()
    for fused in {"qkv_proj", "gate_up_proj"} & leaves:
        parts = {part for part, owner in _FUSED_PARTS.items() if owner == fused}
        by_alias = any(fused in TARGET_ALIASES.get(t, ()) for t in targets)
        if fused in targets or by_alias or parts <= set(targets):
            out.add(fused)
    return out


def apply_lora(model: nn.Module, config: LoraConfig, seed: int | None = None) -> list[str]:
    """Freeze `model`, add adapters to the targeted linears, unfreeze --lora-modules-to-save.

    Returns the adapted module names. With `seed` each adapter's A draws from a generator
    seeded by (seed, module name), so every rank and every pipeline stage agrees.
    """
    names = resolve_targets(model, config.target_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        lora = LoraLinear(getattr(owner, leaf), config.r, config.alpha, config.dropout)
        if seed is not None:
            gen = torch.Generator(device=lora.weight.device)
            lora.reset_lora_parameters(
                gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            )
        setattr(owner, leaf, lora)
    for name in saved_module_names(model, config.modules_to_save):
        for param in model.get_submodule(name).parameters():
            param.requires_grad_(True)
    return names


def saved_module_names(model: nn.Module, modules_to_save: list[str]) -> list[str]:
    """Full names of the modules --lora-modules-to-save selects (by full name or leaf name)."""
    found = [
        name
        for name, _ in model.named_modules()
        if name and (name in modules_to_save or name.rpartition(".")[2] in modules_to_save)
    ]
    missing = [m for m in modules_to_save if not any(n == m or n.endswith("." + m) for n in found)]
    if missing:
        raise ValueError(
            f"--lora-modules-to-save {missing}: no such module in the model "
            "(e.g. lm_head, embed_tokens, norm)"
        )
    return found


def lora_state_dict(
    model: nn.Module, modules_to_save: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The adapter tensors (and --lora-modules-to-save weights) under Meshline names."""
    saved = tuple(saved_module_names(model, modules_to_save or []))
    return {
        name: tensor.detach()
        for name, tensor in model.state_dict().items()
        if ".lora_A." in name
        or ".lora_B." in name
        or any(name.startswith(module + ".") for module in saved)
    }


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (shared tensors counted once)."""
    seen: dict[int, tuple[int, bool]] = {}
    for param in model.parameters():
        seen[id(param)] = (param.numel(), param.requires_grad)
    total = sum(n for n, _ in seen.values())
    return sum(n for n, grad in seen.values() if grad), total
