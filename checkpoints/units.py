"""Work units of a conversion and the interface every checkpoint format implements.

A conversion moves one unit at a time — "pre" (token embedding and its norm), each decoder layer
(its global index), "post" (final norm and output head) — so that memory holds about one layer,
never the model. Inside a unit tensors carry Meshline's global names in the fusions the config asks
for (`layers.3.self_attn.qkv_proj.weight`, see models/hf_adapters.py); a tied output head is not a
tensor of its own ("post" then holds only the norm) and each sink writes it the way its format
expects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from models import build_model
from models.config import ModelConfig
from models.moe_config import MoEConfig

Tensors = dict[str, torch.Tensor]
Unit = str | int
PRE, POST = "pre", "post"

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
"""`--dtype` choices and the torch dtypes they name."""


def units(config: ModelConfig) -> list[Unit]:
    """Every unit of `config`'s model, in forward order."""
    return [PRE, *range(config.num_layers), POST]


def unit_of(name: str) -> Unit:
    """The unit a Meshline parameter name belongs to."""
    if name.startswith("layers."):
        return int(name.split(".", 2)[1])
    if name.startswith(("embed_tokens.", "embed_positions.", "embed_layernorm.")):
        return PRE
    if name.startswith(("norm.", "lm_head.")):
        return POST
    raise ValueError(f"{name!r} is not a Meshline CausalLM parameter name")


def unit_label(unit: Unit) -> str:
    """How progress messages name a unit."""
    return f"layer {unit}" if isinstance(unit, int) else {PRE: "embedding", POST: "head"}[unit]


def expected_names(config: ModelConfig) -> dict[Unit, list[str]]:
    """The tensor names each unit holds for `config` (tied head excluded), from a meta model."""
    model = build_model(config, device="meta")
    names: dict[Unit, list[str]] = {unit: [] for unit in units(config)}
    for name in model.state_dict():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        names[unit_of(name)].append(name)
    return names


def check_unit(tensors: Tensors, unit: Unit, config: ModelConfig, source: str) -> None:
    """Raises ValueError naming `source` when a unit lacks tensors, holds unexpected ones, or one
    has the wrong shape for `config`."""
    want = set(expected_names_cached(config)[unit])
    have = set(tensors)
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        raise ValueError(
            f"{source}: {unit_label(unit)} does not match the model config "
            f"(missing {missing[:6]}, unexpected {extra[:6]}); check --model / the source's "
            "config against the checkpoint"
        )
    shapes = expected_shapes_cached(config)
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(
                f"{source}: {name} has shape {tuple(tensor.shape)} but the model config needs "
                f"{tuple(shapes[name])}; the checkpoint does not hold this model (check --model)"
            )


_CACHE: dict[str, tuple[dict[Unit, list[str]], dict[str, torch.Size]]] = {}


def _cached(config: ModelConfig) -> tuple[dict[Unit, list[str]], dict[str, torch.Size]]:
    key = repr(config.to_dict())
    if key not in _CACHE:
        _CACHE[key] = (expected_names(config), expected_shapes(config))
    return _CACHE[key]


def expected_names_cached(config: ModelConfig) -> dict[Unit, list[str]]:
    """`expected_names`, memoised per config (building even a meta model per unit adds up)."""
    return _cached(config)[0]


def expected_shapes_cached(config: ModelConfig) -> dict[str, torch.Size]:
    """`expected_shapes`, memoised per config."""
    return _cached(config)[1]


def expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Shape of every parameter of `config`'s model (tied head included)."""
    return {n: t.shape for n, t in build_model(config, device="meta").state_dict().items()}


ARCHITECTURE_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "norm_type",
    "position_embedding",
    "activation",
    "attention_bias",
    "qkv_bias",
    "qk_norm",
    "sliding_window",
    "mlp_bias",
    "tie_word_embeddings",
    "embedding_layernorm",
)


def reconcile(own: ModelConfig, named: ModelConfig | None, where: str) -> ModelConfig:
    """The source's own config, after checking that a `--model` config names the same network."""
    if named is None:
        return own
    diffs = [
        f"{name}: checkpoint {getattr(own, name)!r} vs --model {getattr(named, name)!r}"
        for name in ARCHITECTURE_FIELDS
        if getattr(own, name) != getattr(named, name)
    ]
    diffs += _moe_diffs(own.moe, named.moe)
    if diffs:
        raise ValueError(
            f"--model does not match the checkpoint in {where} ({'; '.join(diffs)}); pass the "
            "model the checkpoint holds or leave --model out to use its own config"
        )
    return own


MOE_ARCHITECTURE_FIELDS = (
    "num_experts",
    "top_k",
    "norm_topk_prob",
    "num_shared_experts",
    "shared_expert_ffn",
    "shared_expert_gate",
)
"""The MoE settings that shape the weights or the forward; the loss weights and the capacity
factor are training settings a run may change."""


def _moe_diffs(own: MoEConfig | None, named: MoEConfig | None) -> list[str]:
    if own is None or named is None:
        if (own is None) == (named is None):
            return []
        return [f"moe: checkpoint {_moe_name(own)} vs --model {_moe_name(named)}"]
    return [
        f"moe.{name}: checkpoint {getattr(own, name)!r} vs --model {getattr(named, name)!r}"
        for name in MOE_ARCHITECTURE_FIELDS
        if getattr(own, name) != getattr(named, name)
    ]


def _moe_name(moe: MoEConfig | None) -> str:
    return "dense (no MoE)" if moe is None else f"MoE ({moe.num_experts} experts, top-{moe.top_k})"


class Source(Protocol):
    """A checkpoint opened for reading, one unit at a time."""

    config: ModelConfig
    """The model the checkpoint holds."""
    tokenizer_files: list[Path]
    """Tokenizer files to carry over to the output."""
    iteration: int
    """Training iteration / step the checkpoint was saved at (0 when unknown)."""

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's tensors under Meshline names (see the module doc)."""
        ...


class Sink(Protocol):
    """An output checkpoint written one unit at a time into a directory that is not yet public."""

    def write_unit(self, unit: Unit, tensors: Tensors) -> None:
        """Accepts the next unit, in `units(config)` order."""
        ...

    def finish(self) -> list[str]:
        """Writes what remains (indices, configs, pointers); returns the files, relative."""
        ...

    def abort(self) -> None:
        """Stops writing after a failure (closes files, stops helper threads); idempotent."""
        ...
