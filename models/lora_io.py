"""Saving and loading LoRA adapters: Meshline's format and peft's adapter directory.

Shapes: O out features, I in features, R rank.

An adapter directory holds both forms, written atomically (a temporary directory renamed into
place, so a half-written adapter never looks complete):

- Meshline: `meshline_adapter.safetensors` (tensors under Meshline names, e.g.
  `layers.0.self_attn.qkv_proj.lora_A.weight`) and `meshline_adapter.json` (method, LoRA
  settings, model config);
- peft: `adapter_config.json` + `adapter_model.safetensors` with peft's key names for the HF
  model (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), loadable with
  `peft.PeftModel.from_pretrained` and by Meshline's converter (`--lora-load --merge-lora`).

A fused Meshline projection (qkv_proj, gate_up_proj) with one adapter exports exactly as one
adapter per HF part: the same A and the part's rows of B. Loading a peft adapter back into a
fused model needs the parts to share A (true for Meshline's own exports); otherwise build the
model unfused (`fused_qkv=False`, `fused_gate_up=False`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.config import ModelConfig
from models.families import family_facts
from models.hf_adapters import from_hf, to_hf
from models.lora import LoraConfig, LoraLinear, apply_lora, lora_state_dict

MESHLINE_WEIGHTS = "meshline_adapter.safetensors"
MESHLINE_META = "meshline_adapter.json"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def write_adapter_dir(directory: str | Path, files: dict[str, Any]) -> Path:
    """Write `{filename: tensors dict | JSON-safe dict}` into `directory` atomically."""
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for name, content in files.items():
            if name.endswith(".safetensors"):
                tensors = {k: v.detach().cpu().clone() for k, v in content.items()}
                save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            else:
                (tmp / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def save_lora(
    model: nn.Module, lora: LoraConfig, model_config: ModelConfig, directory: str | Path
) -> Path:
    """Write the adapters of `model` in Meshline's format and as a peft directory."""
    return save_lora_state(
        lora_state_dict(model, lora.modules_to_save), lora, model_config, directory
    )


def save_lora_state(
    state: dict[str, torch.Tensor],
    lora: LoraConfig,
    model_config: ModelConfig,
    directory: str | Path,
) -> Path:
    """`save_lora` for adapter tensors already gathered under Meshline names."""
    meta = {"method": "lora", "lora": vars(lora), "model_config": model_config.to_dict()}
    peft_state, peft_config = to_peft(state, lora, model_config)
    return write_adapter_dir(
        directory,
        {
            MESHLINE_WEIGHTS: state,
            MESHLINE_META: meta,
            PEFT_WEIGHTS: peft_state,
            PEFT_CONFIG: peft_config,
        },
    )


def to_peft(
    state: dict[str, torch.Tensor], lora: LoraConfig, config: ModelConfig
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Meshline adapter tensors → (peft's state dict, peft's adapter_config.json content)."""
    out: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for name, A_RI in state.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removesuffix(".lora_A.weight")
        B_OR = state[f"{module}.lora_B.weight"]
        for hf_name, part_OR in _hf_rows(f"{module}.weight", B_OR, config).items():
            hf_module = hf_name.removesuffix(".weight")
            targets.add(hf_module.rpartition(".")[2])
            out[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = A_RI
            out[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = part_OR
    plain = {k: v for k, v in state.items() if ".lora_A." not in k and ".lora_B." not in k}
    saved = set()
    for hf_name, tensor in to_hf(plain, config).items():
        out[PEFT_PREFIX + hf_name] = tensor
        saved.add(hf_name.rpartition(".")[0].rpartition(".")[2])
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(targets),
        "modules_to_save": sorted(saved) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }
    return out, peft_config


def _hf_rows(name: str, rows: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """`rows` laid out like the output rows of Meshline weight `name`, in HF names and layout."""
    leaf = name.rsplit(".", 2)[-2]
    if leaf in ("q_proj", "k_proj", "v_proj"):
        if family_facts(config.family).fused_lora_qkv:
            raise ValueError(
                f"LoRA export: {config.family} fuses q/k/v into one HF module; adapt qkv_proj "
                f"(query_key_value) rather than {leaf} alone"
            )
        return {f"model.{name}": rows}  # Llama-style HF keeps q/k/v apart under the same names
    return to_hf({name: rows}, config)


def from_peft(peft_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """peft adapter tensors → Meshline names for a model built from `config` (inverse of to_peft)."""
    split = config.replace(fused_qkv=False, fused_gate_up=False)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for key, tensor in peft_state.items():
        name = key.removeprefix(PEFT_PREFIX)
        for suffix in (".lora_A.weight", ".lora_A.default.weight"):
            if name.endswith(suffix):
                module = name.removesuffix(suffix)
                B = peft_state[key.replace("lora_A", "lora_B")]
                for ours, part in from_hf({f"{module}.weight": B}, split).items():
                    pairs[ours.removesuffix(".weight")] = (tensor, part)
                break
        else:
            if ".lora_B." not in name:
                plain[name.replace(".modules_to_save.default", "")] = tensor
    out = from_hf(plain, config) if plain else {}
    for module, (A_RI, B_OR) in _fuse_pairs(pairs, config).items():
        out[f"{module}.lora_A.weight"] = A_RI
        out[f"{module}.lora_B.weight"] = B_OR
    return out


def _fuse_pairs(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], config: ModelConfig
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Merge per-part adapters into the fused module's adapter where `config` fuses them."""
    fuse = {"qkv_proj": config.fused_qkv, "gate_up_proj": config.gated and config.fused_gate_up}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        owner, _, leaf = module.rpartition(".")
        fused = next((f for f, parts in _PARTS.items() if leaf in parts and fuse[f]), None)
        if fused is None:
            out[module] = pair
            continue
        names = [f"{owner}.{p}" for p in _PARTS[fused]]
        if any(n not in pairs for n in names) or any(
            not torch.equal(pairs[n][0], pair[0]) for n in names
        ):
            raise ValueError(
                f"LoRA load: {module} has its own adapter but this model fuses it into "
                f"{owner}.{fused}; build the model with fused_qkv=False / fused_gate_up=False"
            )
        out[f"{owner}.{fused}"] = (pair[0], torch.cat([pairs[n][1] for n in names], dim=0))
    return out


def read_adapter(directory: str | Path, config: ModelConfig) -> tuple[LoraConfig, dict]:
    """(LoRA settings, Meshline-named tensors) of an adapter directory (Meshline or plain peft)."""
    path = Path(directory)
    if (path / MESHLINE_META).is_file():
        meta = json.loads((path / MESHLINE_META).read_text())
        return LoraConfig(**meta["lora"]), load_file(str(path / MESHLINE_WEIGHTS))
    if not (path / PEFT_CONFIG).is_file() or not (path / PEFT_WEIGHTS).is_file():
        raise ValueError(
            f"--lora-load {path}: expected {MESHLINE_META} or {PEFT_CONFIG} + {PEFT_WEIGHTS} "
            "(a Meshline or peft LoRA adapter directory)"
        )
    peft_config = json.loads((path / PEFT_CONFIG).read_text())
    if peft_config.get("peft_type", "LORA") != "LORA" or peft_config.get("use_dora"):
        raise ValueError(f"--lora-load {path}: only plain LoRA adapters load (no DoRA or others)")
    if peft_config.get("use_rslora"):
        raise ValueError(f"--lora-load {path}: rsLoRA scaling (alpha/sqrt(r)) is not supported")
    state = from_peft(load_file(str(path / PEFT_WEIGHTS)), config)
    targets = sorted({k.rsplit(".", 3)[-3] for k in state if ".lora_A." in k})
    saved = sorted({k.rpartition(".")[0] for k in state if ".lora_" not in k})
    lora = LoraConfig(
        r=int(peft_config["r"]),
        alpha=float(peft_config["lora_alpha"]),
        dropout=float(peft_config.get("lora_dropout", 0.0)),
        target_modules=targets,
        modules_to_save=saved,
    )
    return lora, state


def load_lora(model: nn.Module, directory: str | Path, config: ModelConfig) -> LoraConfig:
    """Add the adapters saved in `directory` to `model` (base frozen) and load their weights."""
    lora, state = read_adapter(directory, config)
    apply_lora(model, lora)
    own = {k for k in model.state_dict() if ".lora_" in k}
    missing = sorted(own - set(state))
    if missing:
        raise ValueError(f"--lora-load {directory}: adapter tensors missing for {missing[:4]}")
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(
            f"--lora-load {directory}: tensors that fit no module: {result.unexpected_keys[:4]}"
        )
    return lora


def adapted_modules(model: nn.Module) -> list[str]:
    """Names of the `LoraLinear` modules in `model`."""
    return [name for name, m in model.named_modules() if isinstance(m, LoraLinear)]
