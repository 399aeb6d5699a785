"""Whether a checkpoint directory holds a reward model, read from its config file alone, so
that a model given where its kind cannot serve is refused before any weight is read."""

from __future__ import annotations

from pathlib import Path


def checkpoint_is_reward(directory: Path, load_format: str = "auto") -> bool | None:
    """True for a value-head checkpoint, False for a causal LM, None where the config file cannot
    tell (Megatron, unreadable: the loader then reports or decides)."""
    # imported here: checkpoints.config_files loads torch; an --endpoint evaluation never does
    from checkpoints.config_files import read_model_config
    from checkpoints.registry import AUTO, detect_format

    try:
        fmt = detect_format(directory) if load_format == AUTO else load_format
    except (OSError, ValueError):
        return None
    config = read_model_config(fmt, directory)
    return None if config is None else bool(config.value_head)
