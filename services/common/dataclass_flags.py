"""Command-line flags derived from a config dataclass: one flag per field, named after it
(`output_prefix` -> `--output-prefix`), its type, choices, default and help text (the attribute
docstring) taken from the dataclass, so a command's flags and its typed config cannot drift apart.

A command lists which fields go in which argument group and may adjust a flag (its main spelling,
extra spellings, a metavar, `required`, run-time choices, how its text becomes the field's value)
through `FlagSpec`; everything else is read from the class. `config_values` reads the parsed
flags back as the fields' values, so building the config is `Config(**config_values(...))`.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import re
import textwrap
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from services.common.config_values import strip_optional

_FLAG_PREFIX = re.compile(r"^--[a-z0-9-]+(?:/--[a-z0-9-]+)*:\s*")


@dataclass(frozen=True)
class FlagSpec:
    """How one field's flag differs from what its type and docstring give."""

    flag: str | None = None
    """The flag's main spelling when it is not the field's name (`--http-port` for a field
    `port`); argparse then stores the value under that spelling's name."""
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
    convert: Callable[[Any], Any] | None = None
    """Turns the text given (a list of texts for a list field) into the field's value (a size
    like 2GiB into bytes, a JSON object into a dataclass) in `config_values`; a ValueError it
    raises names the flag. The flag then takes text; an unset value (None) is not converted."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further `add_argument` keywords."""

    def dest(self, name: str) -> str:
        """Where argparse stores field `name`'s value."""
        return self.flag[2:].replace("-", "_") if self.flag else name


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


def _default(f: Any) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default if f.default is not MISSING else None


def _default_text(default: Any) -> str:
    """The end of a help text that says `default` (` (default 16)`), or "" for None, a
    boolean or an empty value, which say nothing."""
    if default is None or isinstance(default, bool) or default in ((), [], ""):
        return ""
    if isinstance(default, float):
        return f" (default {default:g})"
    if isinstance(default, (list, tuple)):
        return f" (default {' '.join(map(str, default))})"
    return f" (default {default})"


def _value_kwargs(tp: Any, spec: FlagSpec) -> dict[str, Any]:
    """`type`, `nargs` and `choices` of a flag that takes a value of type `tp`."""
    origin = typing.get_origin(tp)
    kwargs: dict[str, Any] = {}
    if origin in (tuple, list):
        item = next(a for a in typing.get_args(tp) if a is not Ellipsis)
        kwargs["nargs"] = "+"
        if spec.convert is None:
            kwargs["type"] = item
    elif spec.convert is not None:
        pass  # text, turned into the field's value by `config_values`
    elif origin is typing.Literal:
        choices = typing.get_args(tp)
        kwargs.update(type=type(choices[0]), choices=choices)
    else:
        kwargs["type"] = tp
    if spec.choices is not None:
        kwargs["choices"] = spec.choices
    return kwargs


def add_fields(
    group: argparse._ActionsContainer,
    cls: type,
    names: Iterable[str],
    specs: Mapping[str, FlagSpec] | None = None,
    show_defaults: bool = False,
) -> None:
    """Add the flags of `cls`'s fields `names` to `group` (a parser or an argument group).

    Booleans become `store_true` switches, and `bool | None` fields `--x` / `--no-x` switches
    left None when neither is given; tuples and lists take one or more values; a Literal type
    gives the choices; the dataclass default is the flag's default, said at the end of the help
    text with `show_defaults` (unless it is None, a boolean or empty)."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    docs = attribute_docs(cls)
    specs = specs or {}
    for name in names:
        if name not in by_name:
            raise KeyError(f"{cls.__name__} has no field {name!r}")
        spec = specs.get(name, FlagSpec())
        default = spec.extra.get("default", _default(by_name[name]))
        if spec.help is not None:
            text = spec.help
        else:  # a docstring is plain text; argparse reads % as a format
            text = _FLAG_PREFIX.sub("", docs.get(name, "")).replace("%", "%%")
        if show_defaults and _default_text(default):  # "Most rows (default 32)."
            stop = "." if text.endswith(".") else ""
            text = text.removesuffix(".") + _default_text(default) + stop
        kwargs: dict[str, Any] = {"dest": spec.dest(name), "help": text}
        if spec.metavar is not None:
            kwargs["metavar"] = spec.metavar
        if spec.required:
            kwargs["required"] = True
        else:
            kwargs["default"] = list(default) if isinstance(default, tuple) else default
        tp = strip_optional(hints[name])
        if tp is bool:
            optional = tp is not hints[name]
            kwargs["action"] = argparse.BooleanOptionalAction if optional else "store_true"
        else:
            kwargs.update(_value_kwargs(tp, spec))
        kwargs.update(spec.extra)
        group.add_argument(spec.flag or flag_name(name), *spec.aliases, **kwargs)


def config_values(
    args: argparse.Namespace, cls: type, specs: Mapping[str, FlagSpec] | None = None
) -> dict[str, Any]:
    """The parsed values of `cls`'s fields (lists made tuples where the field is a tuple), each
    turned into the field's value by its spec's `convert` when it has one."""
    hints = typing.get_type_hints(cls)
    specs = specs or {}
    values: dict[str, Any] = {}
    for f in fields(cls):
        spec = specs.get(f.name, FlagSpec())
        if not hasattr(args, spec.dest(f.name)):
            continue
        value = getattr(args, spec.dest(f.name))
        if spec.convert is not None and value is not None:
            value = spec.convert(value)
        if isinstance(value, list) and typing.get_origin(strip_optional(hints[f.name])) is tuple:
            value = tuple(value)
        values[f.name] = value
    return values


class _MainSpelling:
    """An argument group whose flags are added under `flag` instead of their field's name."""

    def __init__(self, group: argparse._ActionsContainer, flag: str) -> None:
        self._group = group
        self._flag = flag

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        """Adds the flag with its first spelling (the field's name) replaced."""
        return self._group.add_argument(self._flag, *names[1:], **kwargs)


def add_renamed_fields(
    group: argparse._ActionsContainer,
    cls: type,
    flags: Mapping[str, str],
    specs: Mapping[str, FlagSpec] | None = None,
) -> None:
    """`add_fields` for fields whose flag is not spelled after the field: `flags` maps each
    field to its flag's main spelling (a converter's `target_tp` is Megatron's
    `--target-tensor-parallel-size`); type, default, help and `specs` apply as in `add_fields`."""
    for name, flag in flags.items():
        add_fields(
            typing.cast(argparse._ActionsContainer, _MainSpelling(group, flag)), cls, (name,), specs
        )
