"""Sizes a checkpoint declares, checked against the bytes it actually holds.

A source's config (config.json, Megatron args, a native config) says how many parameters the
model has; every reader then plans per-layer work and, with `verify`, builds the model from it.
A hostile or corrupted config could declare far more than the files hold, so each source calls
`check_declared_size` before it plans anything: the declared parameter count, at one byte per
parameter (the smallest dtype a checkpoint stores), must fit in the weight files present.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from models.accounting import count_parameters
from models.config import ModelConfig

MIN_BYTES_PER_PARAMETER = 1
"""fp8/int8: no supported checkpoint stores a parameter in fewer bytes."""


def check_declared_size(config: ModelConfig, files: Iterable[Path], where: str) -> None:
    """Raise ValueError naming `where` when `config` declares more parameters than `files` hold."""
    paths = sorted(set(files))
    present = sum(path.stat().st_size for path in paths)
    try:
        declared = count_parameters(config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: the model config is not valid ({exc})") from exc
    if declared * MIN_BYTES_PER_PARAMETER > present:
        raise ValueError(
            f"{where}: the model config declares {declared:,} parameters (num_layers="
            f"{config.num_layers}, hidden_size={config.hidden_size}, ffn_hidden_size="
            f"{config.ffn_hidden_size}, vocab_size={config.vocab_size}) but the weight files hold "
            f"only {present:,} bytes; the config does not describe these files (corrupted or "
            "not trusted)"
        )


def file_in_directory(directory: Path, name: object, where: str) -> Path:
    """`directory / name` when `name` is a plain file name of a regular file in `directory`
    (no path separators, no `..`, no symlink); ValueError naming `where` otherwise."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or os.path.basename(name) != name
        or "\0" in name
    ):
        raise ValueError(
            f"{where} names {name!r}, which is not a file name inside {directory}; a checkpoint "
            "may only refer to its own files"
        )
    path = directory / name
    if path.is_symlink():
        raise ValueError(f"{where} names {name!r}, a symlink; a checkpoint's files must be files")
    return path
