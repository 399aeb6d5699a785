"""Fold a Megatron/ModelLink LoRA checkpoint, saved per tensor-parallel rank, into base weights.

ModelLink trains LoRA with peft's `LoraParallelLinear` on Megatron's parallel layers and saves
the adapter in Megatron's legacy layout (`iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt`, see
megatron_format), each rank holding its own pieces under the adapted layer's name:

| base layer (Megatron name) | parallel style | lora_A [r, in] | lora_B [out, r] |
|---|---|---|---|
| self_attention.query_key_value, mlp.dense_h_to_4h | column | whole on each rank | rows of this rank (split like the layer) |
| self_attention.dense, mlp.dense_4h_to_h | row | columns of this rank (split like the layer) | whole on each rank |

(keys `...query_key_value.lora_A.default.weight`, `.default` optional.) Rank r of the trained
model computes W_r·x + B_r·(A_r·x) on its shard, so the merge is done per rank, exactly as the
model ran: the unit's base tensors are split to the adapter's TP layout (megatron_layout), rank r's
shard becomes W_r + scale·B_r·A_r, and the shards are joined back. Nothing depends on how Megatron
orders rows inside a shard (query groups, [gate; up] halves), and the base may come from any format
and go to any layout. scale = lora_alpha / lora_r from the checkpoint's args (ModelLink's
`--lora-r` / `--lora-alpha`), or from `--lora-r` / `--lora-alpha` when the args lack them (flags that
contradict the args are refused); the delta
is computed in the adapter dtype and added in the weight's dtype, as peft merges. Tensors of the
file that are not LoRA weights (an unfiltered save also holds the frozen base) are not used.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from checkpoints.megatron_format import TRACKER, MegatronSource
from checkpoints.megatron_layout import layer_from_megatron, layer_to_megatron
from checkpoints.units import Tensors, unit_of
from models.config import ModelConfig

_LORA_KEY = re.compile(
    r"^encoder\.layers\.(\d+)\.(?P<module>[\w.]+)\.lora_(?P<part>[AB])(?:\.default)?\.weight$"
)
COLUMN = ("self_attention.query_key_value", "mlp.dense_h_to_4h")
ROW = ("self_attention.dense", "mlp.dense_4h_to_h")


def is_megatron_lora(directory: Path) -> bool:
    """Whether `directory` is a Megatron-layout checkpoint (rather than a peft adapter)."""
    return (directory / TRACKER).is_file() and not (directory / "adapter_config.json").is_file()


class MegatronLoraAdapter:
    """A TP (and PP) sharded Megatron LoRA checkpoint: per layer and module, per TP rank (A, B)."""

    def __init__(
        self,
        directory: Path,
        config: ModelConfig,
        lora_r: int | None = None,
        lora_alpha: float | None = None,
    ) -> None:
        try:
            source = MegatronSource(directory, config, full_weights=False)
        except ValueError as exc:
            raise ValueError(
                f"--lora-load {directory}: the adapter does not fit the model being converted "
                f"({exc})"
            ) from exc
        self.tp = source.tp
        saved_r = getattr(source.args, "lora_r", None)
        saved_alpha = getattr(source.args, "lora_alpha", None)
        for flag, given, saved in (
            ("--lora-r", lora_r, saved_r),
            ("--lora-alpha", lora_alpha, saved_alpha),
        ):
            if given is not None and saved is not None and float(given) != float(saved):
                raise ValueError(
                    f"{flag} {given} contradicts the {saved} recorded in {directory}'s args; "
                    "leave the flag out or pass the value the adapter was trained with"
                )
        r = saved_r or lora_r
        alpha = saved_alpha or lora_alpha
        if not r or not alpha:
            raise ValueError(
                f"--lora-load {directory}: the checkpoint args record no lora_r / lora_alpha; "
                "pass --lora-r and --lora-alpha with the values it was trained with"
            )
        self.scale = float(alpha) / float(r)
        # layer -> module -> part ("A"/"B") -> one tensor per TP rank
        self.pairs: dict[int, dict[str, dict[str, list[torch.Tensor]]]] = {}
        for stage in range(source.pp):
            for chunk in range(source.layout.chunks):
                layers = source.layout.layers(stage, chunk)
                for name, per_rank in source.read_shards(stage, chunk).items():
                    if ".lora_" not in name:
                        continue
                    match = _LORA_KEY.match(name)
                    module = match.group("module") if match else ""
                    if match is None or module not in COLUMN + ROW:
                        raise ValueError(
                            f"--lora-load {directory}: LoRA tensor {name!r} adapts a module "
                            f"outside {list(COLUMN + ROW)}; only the decoder layers' linear "
                            "layers are merged"
                        )
                    layer = layers[int(match.group(1))]
                    by_part = self.pairs.setdefault(layer, {}).setdefault(module, {})
                    by_part[match.group("part")] = per_rank
        if not self.pairs:
            raise ValueError(
                f"--lora-load {directory}: no lora_A / lora_B tensors in the checkpoint"
            )
        for layer, modules in self.pairs.items():
            for module, parts in modules.items():
                if set(parts) != {"A", "B"}:
                    raise ValueError(
                        f"--lora-load {directory}: layer {layer} {module} has lora_{''.join(parts)}"
                        " without its partner"
                    )
        self.directory = directory
        self.merged: set[tuple[int, str]] = set()

    def merge_unit(self, tensors: Tensors, config: ModelConfig) -> Tensors:
        """The unit with each adapted weight replaced by W + scale·B·A, merged per TP rank."""
        unit = unit_of(next(iter(tensors)))
        if not isinstance(unit, int) or unit not in self.pairs:
            return tensors
        shards = layer_to_megatron(unit, tensors, config, self.tp)
        for module, parts in self.pairs[unit].items():
            weights = shards[f"{module}.weight"]
            for rank, (a, b) in enumerate(zip(parts["A"], parts["B"], strict=True)):
                delta = (b @ a) * self.scale
                if delta.shape != weights[rank].shape:
                    raise ValueError(
                        f"--lora-load {self.directory}: layer {unit} {module} TP rank {rank}: "
                        f"B·A has shape {tuple(delta.shape)}, the weight shard "
                        f"{tuple(weights[rank].shape)}; the adapter was trained on another model "
                        "or split differently"
                    )
                weights[rank] = weights[rank] + delta.to(weights[rank].dtype)
            self.merged.add((unit, module))
        return layer_from_megatron(unit, shards, config)

    def check_all_merged(self) -> None:
        """Raises ValueError when a layer of the adapter matched no layer of the model."""
        left = sorted((layer, m) for layer, ms in self.pairs.items() for m in ms)
        missing = [item for item in left if item not in self.merged]
        if missing:
            raise ValueError(
                f"--lora-load {self.directory}: LoRA modules {missing[:5]} (of {len(missing)}) "
                "were not merged; the adapter belongs to another model"
            )
