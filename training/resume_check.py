"""A `--load` checkpoint must be of the model this run builds (issue 37: resumed into another run).

Resuming (not `--finetune`) reads the checkpoint's weights, optimizer and step into this run, so
a checkpoint saved by another run with another architecture fails deep inside DCP with a
shape error in every worker, or worse, loads into a model whose shapes happen to match but
whose layout does not. The checkpoint's `config.json` (written beside `train_state.json` by
the checkpoint manager) is compared field by field with the model this run's flags build, and a
difference is refused before any worker starts, naming the flag and both values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.value_head import value_head_config
from training.config import TrainingConfig
from training.setup import build_model_config

ARCHITECTURE_FLAGS = {
    "family": "--model",
    "hidden_size": "--hidden-size",
    "num_layers": "--num-layers",
    "num_attention_heads": "--num-attention-heads",
    "num_kv_heads": "--num-query-groups",
    "ffn_hidden_size": "--ffn-hidden-size",
    "kv_channels": "--kv-channels",
    "norm_type": "--normalization",
    "position_embedding": "--position-embedding-type",
    "activation": "--swiglu",
    "tie_word_embeddings": "--untie-embeddings-and-output-weights",
    "value_head": "--stage",
}
"""Model fields that define the weights' shapes and meaning, and the flag setting each."""


def check_same_model(config: TrainingConfig, checkpoint: Path) -> None:
    """ValueError naming the flag when `checkpoint`'s model differs from the one `config` builds.

    A checkpoint without `config.json` (older meshline) is not checked here; DCP's own shape
    check still applies when the workers load it.
    """
    saved_path = checkpoint / "config.json"
    if not saved_path.is_file():
        return
    try:
        saved: dict[str, Any] = json.loads(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--load: {saved_path} cannot be read ({exc}); the checkpoint is damaged"
        ) from None

    ours = build_model_config(config)
    if config.run.stage == "rm":  # a reward model saves its value head's config
        ours = value_head_config(ours)
    for name, flag in ARCHITECTURE_FLAGS.items():
        if name not in saved:
            continue
        want = getattr(ours, name, None)
        if saved[name] != want:
            raise ValueError(
                f"--load {checkpoint.parent}: the checkpoint's model has {name} = {saved[name]!r}, "
                f"this run builds {want!r} ({flag}); it was saved by another run. Resume with "
                "that run's model flags, or start from its weights with --finetune and a "
                "matching model"
            )
