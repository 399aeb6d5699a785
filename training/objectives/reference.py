"""A DPO reference read from its own checkpoint (`--ref-model DIR`), checked against the policy.

The reference must be the same network as the policy (the same vocabulary and architecture):
DPO compares the two models' log-probabilities of the same token ids, so a reference with another
vocabulary scores other tokens and one with another architecture is another model. The check
reads only the reference's `config.json` and runs before any worker starts
(`check_reference_config`); the workers then read the weights with the checkpoint manager's
own loader, the path `--load DIR --finetune` takes, so any layout the trainer saved loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from models.config import ModelConfig
from training.checkpoint import CheckpointManager
from training.ckpt.state import TrainState
from training.setup import create_model

if TYPE_CHECKING:
    from training.checkpoint import PathGuard

REF_FLAG = "--ref-model"
"""The flag naming the reference's checkpoint directory."""

IGNORED_FIELDS = frozenset(
    {"init_std", "attention_dropout", "hidden_dropout", "max_position_embeddings", "extra"}
)
"""Model-config fields that do not change what the weights compute on a training sequence."""


def reference_step_dir(directory: str | Path) -> Path:
    """The step directory `--ref-model DIR` means: DIR's `latest` step, or DIR itself when it is
    a step directory (`step-XXXXXX`); ValueError naming the flag otherwise."""
    path = Path(directory)
    if (path / "train_state.json").is_file():
        return path
    pointer = path / "latest"
    if not pointer.is_file():
        raise ValueError(
            f"{REF_FLAG} {directory}: not a Meshline checkpoint (no `latest` file and no "
            "train_state.json); pass a trainer --save directory, or a step-XXXXXX inside it "
            "(convert a HF model first with `meshline convert --save-format native`)"
        )
    text = pointer.read_text(encoding="utf-8").strip()
    if not text.isdigit():
        raise ValueError(f"{REF_FLAG} {directory}: {pointer} should hold a step number")
    step = path / f"step-{int(text):06d}"
    if not (step / "train_state.json").is_file():
        raise ValueError(f"{REF_FLAG} {directory}: `latest` names {step.name}, which is missing")
    return step


def read_reference_config(directory: str | Path) -> ModelConfig:
    """The model config saved with the reference (`config.json` of its step)."""
    path = reference_step_dir(directory) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{REF_FLAG} {directory}: {path} is missing; the reference's architecture cannot be "
            "checked (a checkpoint written by an older Meshline: re-save it)"
        )
    try:
        saved: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return ModelConfig.from_dict(saved)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{REF_FLAG} {directory}: {path} cannot be read ({exc})") from None


def check_reference_config(reference: ModelConfig, policy: ModelConfig, directory: str) -> None:
    """ValueError naming the first field where the reference's model differs from the policy's."""
    ours, theirs = policy.to_dict(), reference.to_dict()
    for name in sorted(set(ours) | set(theirs)):
        if name in IGNORED_FIELDS or ours.get(name) == theirs.get(name):
            continue
        what = "vocabulary" if name == "vocab_size" else "architecture"
        raise ValueError(
            f"{REF_FLAG} {directory}: the reference's {what} differs from the policy's "
            f"({name} = {theirs.get(name)!r}, the policy has {ours.get(name)!r}); DPO needs a "
            "reference of the same model and tokenizer (usually the SFT checkpoint the policy "
            "starts from)"
        )


def load_reference(
    directory: str,
    policy: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    path_guard: PathGuard | None = None,
) -> nn.Module:
    """The reference model, its weights read from `directory` (every rank reads them), frozen."""
    check_reference_config(read_reference_config(directory), policy, directory)
    step_dir = reference_step_dir(directory)
    model = create_model(policy, device, seed=0)  # every weight is then overwritten
    manager = CheckpointManager(step_dir.parent, path_guard=path_guard)
    manager.load(int(step_dir.name.rpartition("-")[2]), TrainState(model=model, save_rng=False))
    return model.to(dtype).requires_grad_(False).eval()


def reference_loader(
    directory: str, path_guard: PathGuard | None = None
) -> Callable[[nn.Module], nn.Module]:
    """What DPO calls once with the policy: the reference from `directory`, on the policy's
    device and in its parameters' dtype, of the policy's model config."""

    def load(policy: nn.Module) -> nn.Module:
        config = policy.config
        assert isinstance(config, ModelConfig), "the registry builds CausalLM models"
        first = next(policy.parameters())
        return load_reference(directory, config, first.device, first.dtype, path_guard=path_guard)

    return load
