"""Fold a LoRA adapter into base weights: W' = W + scale·B·A, per unit, as peft merges it.

`open_adapter` picks the reader: this module's for peft adapter directories, megatron_lora's for
Megatron/ModelLink LoRA checkpoints saved per tensor-parallel rank.

The adapter is a peft directory (`adapter_config.json` + `adapter_model.safetensors`, or a
`.bin` read with `weights_only=True`); its keys name HF modules
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). Each unit is mapped to HF
names, merged there and mapped back, so fused projections (Bloom's `query_key_value`, our
`qkv_proj`) receive the delta exactly where peft would put it. Modules saved whole
(`modules_to_save`, e.g. a re-trained `embed_tokens` / `lm_head` after a vocabulary change) replace
the base weight, as peft's `merge_and_unload` keeps them. The merge runs on whole
(un-split) tensors before any resharding, so a Megatron source of any TP size and any target
layout get the same merged weights. scale = lora_alpha / r (lora_alpha / √r with `use_rslora`);
the delta is computed in the adapter's dtype and added in the weight's dtype, as peft does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from checkpoints.megatron_lora import MegatronLoraAdapter, is_megatron_lora
from checkpoints.torch_files import load_weights_only
from checkpoints.units import Tensors
from models.config import ModelConfig
from models.hf_adapters import from_hf, to_hf

_PREFIX = "base_model.model."
_SAVED = ".modules_to_save.default."


class LoraAdapter:
    """A peft LoRA adapter: per HF module, (A [r, in], B [out, r], scale)."""

    def __init__(self, directory: Path) -> None:
        config_path = directory / "adapter_config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{config_path} is missing: --lora-load must be a peft adapter directory "
                "(save_pretrained of a PeftModel)"
            )
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path} is corrupted ({exc})") from exc
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{config_path}: peft_type {config.get('peft_type')!r} is not LORA")
        for unsupported in ("rank_pattern", "alpha_pattern"):
            if config.get(unsupported):
                raise ValueError(f"{config_path}: per-module {unsupported} is not supported")
        r, alpha = int(config["r"]), float(config["lora_alpha"])
        self.scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        self.fan_in_fan_out = bool(config.get("fan_in_fan_out", False))
        weights = self._load(directory)
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # modules_to_save (e.g. embed_tokens, lm_head): trained copies that replace the weight.
        self.saved: dict[str, torch.Tensor] = {}
        to_save = tuple(config.get("modules_to_save") or ())
        for key, tensor in weights.items():
            # peft saves them under the module's own name (`base_model.model.lm_head.weight`);
            # the in-memory form `...lm_head.modules_to_save.default.weight` is accepted too.
            name = key.removeprefix(_PREFIX).replace(_SAVED, ".")
            if ".lora_" not in key and name.rsplit(".", 2)[-2] in to_save:
                self.saved[name] = tensor
                continue
            if ".lora_A." not in key:
                if ".lora_B." not in key:
                    raise ValueError(f"{directory}: unexpected adapter tensor {key!r}")
                continue
            module = key.removeprefix(_PREFIX).split(".lora_A.")[0]
            b_key = key.replace(".lora_A.", ".lora_B.")
            if b_key not in weights:
                raise ValueError(f"{directory}: {key} has no matching {b_key}")
            self.pairs[module] = (tensor, weights[b_key])
        if not self.pairs and not self.saved:
            raise ValueError(f"{directory}: the adapter holds no lora_A/lora_B tensors")
        if config.get("modules_to_save") and not self.saved:
            raise ValueError(
                f"{config_path}: modules_to_save {config['modules_to_save']} but the adapter "
                "holds none of their tensors"
            )
        self.merged: set[str] = set()

    @staticmethod
    def _load(directory: Path) -> dict[str, torch.Tensor]:
        safetensors = directory / "adapter_model.safetensors"
        if safetensors.is_file():
            try:
                return load_file(safetensors)
            except Exception as exc:
                raise ValueError(f"{safetensors} is not readable safetensors ({exc})") from exc
        binary = directory / "adapter_model.bin"
        if binary.is_file():
            state = load_weights_only(
                binary, [], "re-save the adapter with save_pretrained (safetensors)", mmap=False
            )
            if not isinstance(state, dict):
                raise ValueError(f"{binary} holds a {type(state).__name__}, not a state dict")
            return state
        raise FileNotFoundError(f"{directory} has neither adapter_model.safetensors nor .bin")

    def delta(self, module: str) -> torch.Tensor:
        """scale·B·A of `module` (transposed for fan_in_fan_out layers), in the adapter dtype."""
        a, b = self.pairs[module]
        product = b @ a
        return (product.T if self.fan_in_fan_out else product) * self.scale

    def merge_unit(self, tensors: Tensors, config: ModelConfig) -> Tensors:
        """The unit with every adapted weight replaced by W + delta (others unchanged)."""
        hf = to_hf(tensors, config)
        touched = False
        for name in list(hf):
            if name in self.saved:
                saved = self.saved[name]
                if saved.shape != hf[name].shape:
                    raise ValueError(
                        f"modules_to_save tensor {name} has shape {tuple(saved.shape)}, the "
                        f"model's {tuple(hf[name].shape)}: the adapter was trained on another model"
                    )
                hf[name] = saved.to(hf[name].dtype)
                self.merged.add(name)
                touched = True
                continue
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in self.pairs:
                weight = hf[name]
                delta = self.delta(module)
                if delta.shape != weight.shape:
                    raise ValueError(
                        f"LoRA delta for {module} has shape {tuple(delta.shape)}, the weight "
                        f"{tuple(weight.shape)}: the adapter was trained on another model"
                    )
                hf[name] = weight + delta.to(weight.dtype)
                self.merged.add(module)
                touched = True
        if not touched:
            return tensors
        merged = from_hf(hf, config)
        if config.tie_word_embeddings and "lm_head.weight" not in tensors:
            merged.pop("lm_head.weight", None)
        return merged

    def check_all_merged(self) -> None:
        """Raises ValueError listing adapter modules that matched no weight of the model."""
        left = sorted((set(self.pairs) | set(self.saved)) - self.merged)
        if left:
            raise ValueError(
                f"LoRA modules {left[:5]} (of {len(left)}) match no weight of the model; the "
                "adapter belongs to another architecture"
            )


def open_adapter(
    directory: Path,
    config: ModelConfig,
    lora_r: int | None = None,
    lora_alpha: float | None = None,
) -> LoraAdapter | MegatronLoraAdapter:
    """The `--lora-load` adapter: a Megatron/ModelLink LoRA checkpoint (TP/PP sharded, recognised
    by its latest_checkpointed_iteration.txt) or a peft adapter directory."""
    if is_megatron_lora(directory):
        return MegatronLoraAdapter(directory, config, lora_r, lora_alpha)
    return LoraAdapter(directory)
