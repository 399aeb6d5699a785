"""Command-line flags derived from a config dataclass: one flag per field, named after it
(`output_prefix` -> `--output-prefix`), its type, choices, default and help text (the attribute
docstring) taken from the dataclass, so a command's flags and its typed config cannot drift apart.

A command lists which fields go in which argument group and may adjust a flag (extra spellings,
a metavar, `required`, run-time choices) through `FlagSpec`; everything else is read from the class.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import re
import textwrap
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from services.common.config_values import strip_optional

_FLAG_PREFIX = re.compile(r"^--[a-z0-9-]+(?:/--[a-z0-9-]+)*:\s*")


@dataclass(frozen=True)
class FlagSpec:
    """How one field's flag differs from what its type and docstring give."""

    aliases: tuple[str, ...] = ()
    """Other spellings of the flag (old scripts' names)."""
    metavar: str | None = None
    """The placeholder shown in --help."""
    required: bool = False
    """The flag must be given."""
    choices: tuple[Any, ...] | None = None
    """Allowed values when the type does not say them (a Literal type does)."""
    help: str | None = None
    """Help text replacing the docstring (for text computed at run time)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further `add_argument` keywords."""


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string right after `name: type = ...`) of `cls` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        node = ast.parse(source).body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, nxt in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_name(name: str) -> str:
    """`output_prefix` -> `--output-prefix`."""
    return "--" + name.replace("_", "-")


def add_fields(
    group: argparse._ActionsContainer,
    cls: type,
    names: Iterable[str],
    specs: Mapping[str, FlagSpec] | None = None,
) -> None:
    """Add the flags of `cls`'s fields `names` to `group` (a parser or an argument group).

    Booleans become `store_true` switches; tuples and lists take one or more values; a Literal
    type gives the choices; the dataclass default is the flag's default (shown in --help)."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    docs = attribute_docs(cls)
    specs = specs or {}
    for name in names:
        if name not in by_name:
            raise KeyError(f"{cls.__name__} has no field {name!r}")
        spec = specs.get(name, FlagSpec())
        f = by_name[name]
        default = f.default if f.default is not MISSING else None
        if f.default_factory is not MISSING:
            default = f.default_factory()
        text = spec.help if spec.help is not None else _FLAG_PREFIX.sub("", docs.get(name, ""))
        kwargs: dict[str, Any] = {"dest": name, "help": text}
        if spec.metavar is not None:
            kwargs["metavar"] = spec.metavar
        if spec.required:
            kwargs["required"] = True
        else:
            kwargs["default"] = list(default) if isinstance(default, tuple) else default
        tp = strip_optional(hints[name])
        origin = typing.get_origin(tp)
        if tp is bool:
            kwargs.update(spec.extra)
            group.add_argument(flag_name(name), *spec.aliases, action="store_true", **kwargs)
            continue
        if origin in (tuple, list):
            item = next(a for a in typing.get_args(tp) if a is not Ellipsis)
            kwargs.update(nargs="+", type=item)
        elif origin is typing.Literal:
            choices = typing.get_args(tp)
            kwargs.update(type=type(choices[0]), choices=choices)
        else:
            kwargs["type"] = tp
        if spec.choices is not None:
            kwargs["choices"] = spec.choices
        kwargs.update(spec.extra)
        group.add_argument(flag_name(name), *spec.aliases, **kwargs)


def config_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The parsed values of `cls`'s fields (lists made tuples where the field is a tuple)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if isinstance(value, list) and typing.get_origin(strip_optional(hints[f.name])) is tuple:
            value = tuple(value)
        values[f.name] = value
    return values
