"""Load a checkpoint directory for serving: model weights, config, tokenizer, LoRA merged.

Reading goes through the format registry (`checkpoints/registry.py`), the converter's readers:
the formats marked `serves` there — HF (config.json + safetensors, sharded or not), native (a
trainer save dir or step dir; DCP read pickle-free), Megatron (any saved TP/PP/virtual layout,
merged to whole tensors) — and `--load-format auto` detects which one a directory holds
(`detect_format`). Each yields units (embedding, each layer, head) under Meshline names; a LoRA
adapter (`--lora-load`, PEFT format) is merged unit by unit with the converter's `LoraAdapter`,
as peft's `merge_and_unload` would. The whole model is
then built on the serving device; tensor-parallel serving reshards it afterwards, so the saved
layout never has to match the serving one.

A quantized checkpoint (`quantization.json`) is served on its int8 / int4 codes
(engine/quantized_model.py), dequantized only where a LoRA adapter is merged into it or the
caller asks for float weights (tensor-/pipeline-parallel serving reshards float weights).

The tokenizer comes from `--tokenizer` or the checkpoint (`tokenizer.model`, `tokenizer.json`,
or a `tokenizer/` folder holding either).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints.config_files import read_model_config
from checkpoints.lora import LoraAdapter
from checkpoints.registry import AUTO, SERVE_CHOICES, SERVE_FORMATS, detect_format, get_format
from checkpoints.units import units
from engine.quantized_model import (
    read_quantized_state,
    swap_in_quant_linears,
    tie_quantized_head,
)
from models import build_model
from models.config import ModelConfig
from models.tokenizer import Tokenizer, build_tokenizer
from models.transformer import CausalLM

StateDict = dict[str, torch.Tensor]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to serve and where it came from."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    load_format: str
    path: Path
    name: str


def read_state(
    directory: Path, fmt: str, lora: Path | None, *, reward_model: bool = False
) -> tuple[ModelConfig, StateDict, Path]:
    """(config, full state dict under Meshline names, directory holding tokenizer files).

    `reward_model`: the checkpoint must hold a scalar value head (a causal LM is refused);
    else it must not (a reward model cannot generate)."""
    try:
        source = get_format(fmt, "--load-format", SERVE_FORMATS).open_source(directory, None, None)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--load {directory} ({fmt}): {exc}") from exc
    if source.config.value_head and not reward_model:
        # its forward gives one score per position, not logits
        raise ValueError(
            f"--load {directory}: a reward model (a scalar value head, `meshline train --stage "
            "rm`) cannot generate; serve it with `meshline serve inference --load DIR`, which "
            "answers its Reward RPC and POST /pooling, or give a causal LM"
        )
    if reward_model and not source.config.value_head:
        raise ValueError(
            f"--load {directory}: a causal LM, not a reward model (no scalar value head); "
            "give a `meshline train --stage rm` checkpoint or a ...ForSequenceClassification "
            "with one label"
        )
    try:
        adapter = LoraAdapter(lora) if lora is not None else None
    except KeyError as exc:
        raise ValueError(f"--lora-load {lora}: adapter_config.json lacks {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ValueError(f"--lora-load {lora}: {exc}") from exc
    state: StateDict = {}
    try:
        for unit in units(source.config):
            tensors = source.read_unit(unit)
            if adapter is not None:
                tensors = adapter.merge_unit(tensors, source.config)
            state.update(tensors)
        if adapter is not None:
            adapter.check_all_merged()
    except (OSError, ValueError) as exc:
        raise ValueError(f"--load {directory} ({fmt}): {exc}") from exc
    tokenizer_dir = source.tokenizer_files[0].parent if source.tokenizer_files else directory
    return source.config, state, tokenizer_dir


def is_reward_checkpoint(directory: Path, load_format: str = AUTO) -> bool:
    """Whether `directory` holds a reward model (a scalar value head), read from its config file
    alone; False where that cannot tell (no JSON config: Megatron; unreadable: the loader then
    reports it)."""
    try:
        fmt = detect_format(directory) if load_format == AUTO else load_format
    except (OSError, ValueError):
        return False
    config = read_model_config(fmt, directory)
    return config is not None and config.value_head


def find_tokenizer(directory: Path, explicit: Path | None) -> Tokenizer | None:
    """The tokenizer given by `--tokenizer`, else one stored in the checkpoint, else None."""
    if explicit is not None:
        return _tokenizer_at(explicit)
    for place in (directory, directory / "tokenizer"):
        if place.is_dir():
            found = _tokenizer_at(place, required=False)
            if found is not None:
                return found
    return None


def _tokenizer_at(path: Path, required: bool = True) -> Tokenizer | None:
    if path.is_file():
        return build_tokenizer("SentencePiece", path)
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return build_tokenizer("PretrainedFromHF", path)
    models = sorted(path.glob("*.model"))
    if models:
        return build_tokenizer("SentencePiece", models[0])
    if required:
        raise ValueError(
            f"--tokenizer {path}: no tokenizer.json, tokenizer_config.json or *.model in it"
        )
    return None


def load_checkpoint(
    directory: Path,
    *,
    load_format: str = "auto",
    dtype: str = "auto",
    tokenizer: Path | None = None,
    lora: Path | None = None,
    device: torch.device | str = "cpu",
    quantized_weights: bool = True,
    reward_model: bool = False,
) -> LoadedModel:
    """Build the served model from a checkpoint directory (ValueError naming the bad flag).

    A quantized checkpoint is served on its codes (`QuantLinear` layers) unless
    `quantized_weights` is False or a LoRA adapter is merged: then dequantized.
    `reward_model`: load a reward model (a value head) instead of a causal LM (see
    `read_state`)."""
    if load_format not in SERVE_CHOICES:
        raise ValueError(f"--load-format {load_format!r}: choose one of {list(SERVE_CHOICES)}")
    fmt = detect_format(directory) if load_format == AUTO else load_format
    on_codes = fmt == "quantized" and quantized_weights and lora is None
    if on_codes:  # the engine computes on the codes (engine/quantized_model.py)
        try:
            config, state, weights, scheme, tokenizer_dir = read_quantized_state(directory)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--load {directory} ({fmt}): {exc}") from exc
    else:
        config, state, tokenizer_dir = read_state(directory, fmt, lora, reward_model=reward_model)
    if dtype == "auto":
        floats = [t.dtype for t in state.values() if t.is_floating_point()]
        torch_dtype = floats[0] if floats else torch.float32
    else:
        torch_dtype = DTYPES[dtype]
    model = build_model(config, device="meta", dtype=torch_dtype)
    if on_codes:
        state.update(swap_in_quant_linears(model, weights, scheme.weights, scheme.embedding))
    model.to_empty(device=device)
    model.init_weights(seed=0)
    tied = tie_quantized_head(model) if on_codes else []
    missing, unexpected = model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight" and k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"--load {directory}: checkpoint does not match its config (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    model.tie_weights()
    model.eval()
    registry_name = config.extra.get("registry_name") if config.extra else None
    return LoadedModel(
        model,
        config,
        find_tokenizer(tokenizer_dir, tokenizer),
        fmt,
        directory,
        str(registry_name or directory.name),
    )


def read_config(directory: Path, load_format: str = AUTO) -> ModelConfig:
    """The model a checkpoint holds, read without its weights (to check flags before loading)."""
    if load_format not in SERVE_CHOICES:
        raise ValueError(f"--load-format {load_format!r}: choose one of {list(SERVE_CHOICES)}")
    try:
        fmt = detect_format(directory) if load_format == AUTO else load_format
        return (
            get_format(fmt, "--load-format", SERVE_FORMATS)
            .open_source(directory, None, None)
            .config
        )
    except (OSError, ValueError) as exc:
        raise ValueError(f"--load {directory} ({load_format}): {exc}") from exc
