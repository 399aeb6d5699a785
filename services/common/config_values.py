"""Settings that reach a dataclass-derived command line from outside argparse, checked alike.

A command whose flags are its config dataclasses' fields (`dataclass_flags`) may also take a
`--config FILE` of settings (YAML or TOML) and command lines from untrusted requests. This module
reads such a file into a mapping, checks each value against its field's type (naming the key and
the type wanted), and bounds a command line before argparse parses it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib
import yaml

MAX_ARGS = 20_000
"""Command-line arguments accepted at most (long --data-path lists included)."""
MAX_FLAGS = 2_000
"""Option strings (`--name`) accepted at most: argparse's cost grows with their square."""
MAX_ARG_CHARS = 65_536
"""Characters of one argument at most (a path, a data blend entry)."""


def check_argv(argv: list[str]) -> None:
    """ValueError naming the limit when `argv` is too long to parse in bounded time.

    One linear pass before argparse, whose cost grows with the square of the number of option
    strings (100k arguments kept a service thread busy for minutes).
    """
    if len(argv) > MAX_ARGS:
        raise ValueError(
            f"{len(argv)} arguments: at most {MAX_ARGS} are accepted; put long settings in "
            "--config FILE"
        )
    flags = 0
    for position, arg in enumerate(argv):
        if len(arg) > MAX_ARG_CHARS:
            raise ValueError(
                f"argument {position} ({arg[:40]!r}...) is {len(arg)} characters; at most "
                f"{MAX_ARG_CHARS} are accepted"
            )
        flags += arg.startswith("-") and not is_number(arg)
    if flags > MAX_FLAGS:
        raise ValueError(
            f"{flags} flags: at most {MAX_FLAGS} are accepted (each flag once is ~300); drop "
            "the repeated ones or use --config FILE"
        )


def is_number(text: str) -> bool:
    """Whether `text` reads as a number (`-1`, `1e-3`: a value, not a flag)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_settings_file(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """The top-level mapping of a YAML (.yaml, .yml) or TOML (.toml) settings file; ValueError
    naming `flag` and the file when it is missing, of another kind, invalid or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(text) or {}
        else:
            raise ValueError(
                f"{flag} {path}: unknown extension {path.suffix!r}; use .yaml, .yml or .toml"
            )
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{flag} {path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} {path}: the top level must be a mapping of settings")
    return raw


def strip_optional(tp: Any) -> Any:
    """`X` for `X | None` (and `Optional[X]`); any other type unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def type_name(tp: Any) -> str:
    """How an error names the type a setting must have ("a number", "one of 'a', 'b'")."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin is list:
        item = typing.get_args(tp)[0]
        plural = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(item, type_name(item))}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def type_ok(value: Any, tp: Any) -> bool:
    """Whether a config-file `value` has the field type `tp` (an int is a number, not a bool)."""
    if value is None:
        return tp is not strip_optional(tp)  # None only where the field is optional
    tp = strip_optional(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(type_ok(v, item) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True  # a type the flags do not declare (none today): the section checks it


def check_types(values: Mapping[str, Any], field_types: Mapping[str, Any], source: str) -> None:
    """ValueError naming the key when a value from `source` (--config FILE) does not have its
    field's type (`field_types`: field name -> annotation; other names are left alone)."""
    for name, value in values.items():
        if name in field_types and not type_ok(value, field_types[name]):
            wanted = type_name(strip_optional(field_types[name]))
            hint = ""
            if isinstance(value, str) and is_number(value):
                hint = " (YAML reads 1e-3 as text: write 1.0e-3)"
            raise ValueError(
                f"{source}: setting {name!r} must be {wanted}, got {type(value).__name__} "
                f"{str(value)[:60]!r}{hint}"
            )
