"""What a checkpoint holds, split into DCP tensors and JSON-safe values.

Model and optimizer state use the layout `torch.distributed.checkpoint.state_dict` produces with
`flatten_optimizer_state_dict=True` — `model.<fqn>`, `optim.state.<fqn>.<key>`,
`optim.param_groups.<fqn>.<key>` under global parameter names — so DDP (plain tensors), FSDP2 and
ZeRO-1 (DTensors sharded over the data-parallel ranks, under TP over a (tp, dp) mesh)
checkpoints are interchangeable. Tensors go to DCP; everything else
(param-group hyper-parameters, scheduler, loss scaler, RNG) goes to JSON, so loading never
unpickles.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from kernels import device
from parallel.zero1 import ZeroOneOptimizer

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState:
    """Everything a resume needs; `extra` holds JSON-safe counters (step, consumed samples...)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    loss_scaler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    save_rng: bool = True


def model_optimizer_state(state: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, flat optimizer state) in the interchangeable layout described above."""
    optimizer = state.optimizer
    if optimizer is None:
        return get_model_state_dict(state.model, options=_OPTIONS), {}
    if isinstance(optimizer, ZeroOneOptimizer):
        return get_model_state_dict(state.model, options=_OPTIONS), optimizer.sharded_state_dict()
    return get_state_dict(state.model, optimizer, options=_OPTIONS)


def set_model_optimizer_state(
    state: TrainState, model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> None:
    """Apply loaded model/optimizer state (the output of `model_optimizer_state`, filled in)."""
    optimizer = state.optimizer
    if optimizer is None:
        set_model_state_dict(state.model, model_sd, options=_OPTIONS)
    elif isinstance(optimizer, ZeroOneOptimizer):
        set_model_state_dict(state.model, model_sd, options=_OPTIONS)
        optimizer.load_sharded_state_dict(optim_sd)
    else:
        set_state_dict(
            state.model,
            optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=_OPTIONS,
        )


def tensor_tree(named: Iterable[tuple[str, torch.Tensor]]) -> nn.Module:
    """A module tree holding each tensor under its dotted name, for DCP's state-dict helpers.

    Tensors are set in `_parameters` as they are: fp32 master copies are plain (or DTensor)
    leaves, not `nn.Parameter`s, and must stay the very objects the optimizer steps, so that
    loading into the tree restores them in place.
    """
    root = nn.Module()
    for name, tensor in named:
        owner_name, _, leaf = name.rpartition(".")
        owner = root
        for part in owner_name.split(".") if owner_name else []:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        owner._parameters[leaf] = tensor  # type: ignore[assignment]
    return root


def split_tensors(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a flat state dict into (tensors, JSON-safe rest); raise on values JSON cannot hold."""
    tensors, plain = {}, {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[key] = to_json_safe(value, key)
    return tensors, plain


def to_json_safe(value: Any, where: str) -> Any:
    """`value` as JSON types (tuples become lists); a clear error for anything else."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [to_json_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): to_json_safe(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(
        f"checkpoint value {where!r} has type {type(value).__name__}, which is not JSON-safe; "
        f"keep non-tensor training state to numbers, strings, lists and dicts"
    )


def restore_tuples(loaded: Any, template: Any) -> Any:
    """Give JSON-loaded lists the tuple type the live value had (Adam's `betas`, ...)."""
    if isinstance(template, tuple) and isinstance(loaded, list):
        return tuple(restore_tuples(v, t) for v, t in zip(loaded, template, strict=False))
    return loaded


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state_to_json() -> dict[str, Any]:
    """This process's Python, NumPy, torch and device RNG states as JSON values."""
    state = device.get_rng_state()
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    encoded: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(state["torch"]),
    }
    if "device" in state:
        encoded["device"] = _b64(state["device"])
    return encoded


def rng_state_from_json(encoded: dict[str, Any]) -> None:
    """Restore what `rng_state_to_json` produced."""
    version, internal, gauss = encoded["python"]
    kind, keys, pos, has_gauss, cached = encoded["numpy"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(encoded["torch"]))
    if "device" in encoded:
        device.current().set_rng_state(_unb64(encoded["device"]))
