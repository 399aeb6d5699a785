"""A checkpoint's model config from its JSON file alone, without importing torch.

The CLIs' layout checks (`meshline serve --tensor-parallel-size`, `meshline convert
--target-tensor-parallel-size`) run on it before anything imports torch, so a refusal takes well
under a second. Only the formats that keep their model config in a JSON file are read here (HF's
config.json, a native step's config.json); for any other format, or a file that does not parse,
`read_model_config` returns None and the caller's full check (through the format's reader) runs
later with its own messages.
"""

from __future__ import annotations

import json
from pathlib import Path

from models.config import ModelConfig
from models.hf_config import config_from_hf

MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this is left to the format's reader (which bounds it itself)."""


def _json(path: Path) -> dict | None:
    if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def _native_step(directory: Path) -> Path | None:
    """The step directory a native path means, as `native_format.find_step` finds it."""
    if (directory / ".metadata").is_file():
        return directory
    pointer = directory / "latest"
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    return directory / f"step-{int(text):06d}" if text.isdigit() else None


def read_model_config(fmt: str, directory: Path) -> ModelConfig | None:
    """The model config of the `fmt` checkpoint at `directory`, or None when it cannot be read
    without the format's reader (not a JSON-config format, missing or malformed file)."""
    try:
        if fmt == "hf" and directory.is_dir():
            data = _json(directory / "config.json")
            return config_from_hf(data) if data is not None else None
        if fmt == "native" and directory.is_dir():
            step = _native_step(directory)
            data = _json(step / "config.json") if step is not None else None
            return ModelConfig.from_dict(data) if data is not None else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, NotImplementedError):
        return None  # the format's reader reports it, with its own message
    return None
