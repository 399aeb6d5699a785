"""Checks of a LoRA adapter directory that read no weight (torch-free: flag validation uses them).

A served adapter is a peft directory: `adapter_config.json` + `adapter_model.safetensors`, as
`PeftModel.save_pretrained` and Meshline's LoRA training write it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_ADAPTER_NAME = 128
"""Longest adapter name (a request's `model` field)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
"""The files of a peft adapter directory that serving reads."""


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
