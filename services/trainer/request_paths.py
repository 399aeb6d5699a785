"""Every path a training request names, confined to the data roots and passed on resolved.

A request's flags (and any `--config` file it names) can name files through these settings;
each is resolved once with `services.common.paths.resolve_under_roots` and the *resolved* config
is what the workers get: `argv_from_config` turns it back into flags, so the workers never see
the requester's strings nor re-read the `--config` file. Data prefixes and tokenizer folders
are expanded to the files they stand for, and each of those is confined too, so a `.bin` or a
`tokenizer.json` that is a symlink leaving the roots is refused.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import typing
from collections.abc import Sequence
from dataclasses import MISSING, fields
from pathlib import Path

from services.common.config_values import is_number
from services.common.paths import confine_tree, resolve_under_roots
from services.trainer.train_config import SECTIONS, TrainConfig

PATH_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("data", "data_path", "--data-path"),
    ("data", "train_data_path", "--train-data-path"),
    ("data", "valid_data_path", "--valid-data-path"),
    ("data", "test_data_path", "--test-data-path"),
    ("data", "data_cache_path", "--data-cache-path"),
    ("data", "tokenizer_model", "--tokenizer-model"),
    ("data", "tokenizer_name_or_path", "--tokenizer-name-or-path"),
    ("run", "save", "--save"),
    ("run", "load", "--load"),
    ("run", "ref_model", "--ref-model"),
    ("run", "log_dir", "--log-dir/--tensorboard-dir"),
    ("run", "profile_save_path", "--profile-save-path"),
    ("parallel", "optimizer_nvme_path", "--optimizer-nvme-path"),
    ("parallel", "param_nvme_path", "--param-nvme-path"),
    ("peft", "lora_load", "--lora-load"),
    ("rl", "reward_model", "--reward-model"),
)
"""(section, field, flag) of every training setting that names a file or directory."""

# Folders whose every file the workers read: a symlink inside must not lead outside the roots.
_FOLDERS_READ_WHOLE = frozenset(
    {"tokenizer_name_or_path", "load", "ref_model", "lora_load", "reward_model"}
)

PERMISSION_DENIED_TAG = "PERMISSION_DENIED"
"""A worker's message for a path refused at use time starts with this (the job's status)."""


def _prefix_files(prefix: Path) -> list[Path]:
    """The files a data prefix stands for (`.bin/.idx`, `_packed_*`, `-NNNNN.arrow`, ...)."""
    return [Path(p) for p in glob.glob(glob.escape(str(prefix)) + "*")]


def confine_config(config: TrainConfig, roots: Sequence[Path]) -> TrainConfig:
    """A copy of `config` with every path resolved under `roots` (PermissionDenied if one leaves).

    Weights in the data-path lists are kept as given. The files behind each data prefix and
    inside a tokenizer folder are checked as well (a symlink among them may point anywhere).
    """
    sections = {name: dataclasses.replace(getattr(config, name)) for name in SECTIONS}
    run = sections["run"]
    if run.profile and not run.profile_save_path:  # the default is a path too: confine it
        run.profile_save_path = run.profile_dir()
    for section, name, flag in PATH_SETTINGS:
        value = getattr(sections[section], name)
        field = f"args ({flag})"
        if isinstance(value, list):
            resolved = []
            for token in value:
                if is_number(token):
                    resolved.append(token)
                    continue
                prefix = resolve_under_roots(token, roots, field)
                for path in _prefix_files(prefix):
                    resolve_under_roots(str(path), roots, field)
                resolved.append(str(prefix))
            setattr(sections[section], name, resolved)
        elif value:
            path = resolve_under_roots(value, roots, field)
            if name in _FOLDERS_READ_WHOLE:
                confine_tree(path, roots, field)
            setattr(sections[section], name, str(path))
    confined = TrainConfig(**sections)
    for flag, cache_dir in _default_cache_dirs(confined):
        resolve_under_roots(cache_dir, roots, f"args ({flag})")
    return confined


def _default_cache_dirs(config: TrainConfig) -> list[tuple[str, str]]:
    """Without --data-cache-path the sample index goes to `cache/` beside each shard."""
    data = config.data
    if data.data_cache_path or data.mock_data:
        return []
    prefixes = [*data.data_path, *data.train_data_path, *data.valid_data_path]
    prefixes += data.test_data_path
    flag = "--data-cache-path (default: cache/ beside the data)"
    dirs = {str(Path(p).parent / "cache") for p in prefixes if not is_number(p)}
    return [(flag, d) for d in sorted(dirs)]


def argv_from_config(config: TrainConfig) -> list[str]:
    """Training flags that `services.trainer.arguments.parse_args` turns back into `config`.

    Only settings that differ from their defaults are written; every setting has a flag of its
    own name (booleans are store-true flags, all defaulting to False).
    """
    argv: list[str] = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            value = getattr(getattr(config, section), f.name)
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc,operator]
            if value == default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if hints[f.name] is bool:
                assert value is True, f"{flag}: a store-true flag cannot express {value!r}"
                argv.append(flag)
            elif isinstance(value, list):
                argv += [flag, *(str(item) for item in value)]
            else:
                assert value is not None, f"{flag}: no flag sets it back to None"
                argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def path_values(config: TrainConfig) -> list[tuple[str, str]]:
    """(flag, path) of every path the config names (weights left out), for use-time checks."""
    out = []
    for section, name, flag in PATH_SETTINGS:
        value = getattr(getattr(config, section), name)
        for item in value if isinstance(value, list) else [value]:
            if item and not is_number(item):
                out.append((flag, os.fspath(item)))
    return out + _default_cache_dirs(config)
