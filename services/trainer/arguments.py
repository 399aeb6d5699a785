"""Megatron/ModelLink command-line flags and `--config FILE` mapped onto `TrainConfig`.

Every field of the section dataclasses (`config_sections`, `run_sections`) is a flag named after it
(`micro_batch_size` -> `--micro-batch-size`); its type, choices and help text (the attribute
docstring) come from the dataclass, so the mapping lives in one place. Precedence: dataclass
defaults < `--config FILE` (YAML or TOML; nested `{section: {field: value}}` or flat flag names)
< flags on the command line.
"""

from __future__ import annotations

import argparse
import functools
import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from services.common import megatron_flags
from services.common.config_values import (
    check_argv,
    check_types,
    read_settings_file,
    strip_optional,
)
from services.common.dataclass_flags import attribute_docs
from services.trainer.train_config import SECTIONS, TrainConfig

# Older spellings that scripts still use, mapped to the field they set.
ALIASES: dict[str, str] = megatron_flags.FIELD_ALIASES


@functools.lru_cache(maxsize=1)
def field_docs() -> dict[str, str]:
    """Attribute docstrings of every section field, keyed by field name."""
    docs: dict[str, str] = {}
    for cls in SECTIONS.values():
        docs.update(attribute_docs(cls))
    return docs


@functools.lru_cache(maxsize=1)
def field_index() -> dict[str, tuple[str, Any]]:
    """Field name -> (section name, resolved type) for every flag-backed field."""
    index: dict[str, tuple[str, Any]] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            assert f.name not in index, f"field {f.name} appears in two sections"
            index[f.name] = (section, hints[f.name])
    return index


def _add_flag(parser: argparse.ArgumentParser, name: str, tp: Any, help_text: str) -> None:
    flag = "--" + name.replace("_", "-")
    names = [flag, *(alias for alias, target in ALIASES.items() if target == name)]
    base = strip_optional(tp)
    kwargs: dict[str, Any] = {"dest": name, "help": help_text, "default": argparse.SUPPRESS}
    if base is bool:
        parser.add_argument(*names, action="store_true", **kwargs)
        return
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        choices = typing.get_args(base)
        parser.add_argument(*names, type=type(choices[0]), choices=choices, **kwargs)
    elif origin is list:
        (item,) = typing.get_args(base)
        nargs: Any = 3 if name == "rampup_batch_size" else "+"
        metavar = ("START", "INCREMENT", "SAMPLES") if name == "rampup_batch_size" else None
        parser.add_argument(*names, type=item, nargs=nargs, metavar=metavar, **kwargs)
    else:
        parser.add_argument(*names, type=base, **kwargs)


def build_parser(prog: str = "meshline train") -> argparse.ArgumentParser:
    """The argparse parser for every training flag (defaults suppressed: unset flags stay unset)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train or fine-tune a model (Megatron/ModelLink flag names).",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config", help="YAML or TOML file of settings; flags on the command line override it"
    )
    docs = field_docs()
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip().splitlines()[0])
        for name, (sec, tp) in field_index().items():
            if sec == section:
                _add_flag(group, name, tp, docs.get(name, ""))  # type: ignore[arg-type]
    group = parser.add_argument_group("recompute")
    group.add_argument(
        "--recompute-activations",
        dest="recompute_granularity",
        action="store_const",
        const="selective",
        help="Same as --recompute-granularity selective.",
    )
    megatron_flags.add_flags(parser)
    return parser


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML/TOML settings file into `{field_name: value}` (nested or flat keys accepted)."""
    path = Path(path)
    raw = read_settings_file(path)
    index = field_index()
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        items = value.items() if key in SECTIONS and isinstance(value, dict) else [(key, value)]
        for sub_key, sub_value in items:
            name = str(sub_key).lstrip("-").replace("-", "_")
            if name not in index:
                raise ValueError(
                    f"--config {path}: unknown setting {sub_key!r} (not a training flag)"
                )
            flat[name] = sub_value
    return flat


def config_from_values(values: dict[str, Any]) -> TrainConfig:
    """Build the config from `{field_name: value}`; unset fields keep their defaults."""
    per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    index = field_index()
    for name, value in values.items():
        if name not in index:
            raise ValueError(f"unknown training setting {name!r}")
        section, tp = index[name]
        if strip_optional(tp) is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        per_section[section][name] = value
    return TrainConfig(**{name: SECTIONS[name](**vals) for name, vals in per_section.items()})


def parse_args(argv: list[str] | None = None, *, read_files: bool = False) -> TrainConfig:
    """Parse flags (and `--config FILE`) into a TrainConfig; bad values raise ValueError naming the flag.

    Megatron/ModelLink flags that are not fields are resolved by `megatron_flags.apply`
    (mapped, accepted or refused; none without effect); `read_files` lets
    flags whose value is a file to read at parse time (--deepspeed-config) through (the command
    line does; a service request's paths are untrusted). The result is checked
    section by section; call `config.validate(world_size)` once the job size is known for the
    cross-flag checks.
    """
    check_argv(sys.argv[1:] if argv is None else argv)
    namespace = build_parser().parse_args(argv)
    given = vars(namespace)
    config_path = given.pop("config", None)
    values = load_config_file(config_path) if config_path else {}
    field_types = {name: tp for name, (_, tp) in field_index().items()}
    check_types(values, field_types, f"--config {config_path}")
    values.update(given)
    values = megatron_flags.apply(values, read_files=read_files)
    config = config_from_values(values)
    return config


def defaults() -> dict[str, Any]:
    """Every field's default value, keyed by field name (for docs and tests)."""
    out: dict[str, Any] = {}
    for cls in SECTIONS.values():
        for f in fields(cls):
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:
                out[f.name] = f.default_factory()
    return out
