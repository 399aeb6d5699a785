"""The one table type for Megatron-LM / ModelLink flags that are not a command's own settings.

Every command that takes such flags (`meshline train`, `evaluate`, `generate`) lists them as
`CompatFlag` rows, each of one kind, so no flag is accepted without effect:

- `map`: translated onto the command's own settings (`--checkpoint-activations` -> recompute);
- `same`: nothing to translate, because Meshline always behaves as the flag asks (the note says
  why: fused kernels are chosen per device, inference runs without dropout, ...);
- `check`: a statement about the checkpoint (`--num-layers 32` to `meshline evaluate`), compared
  with what the checkpoint holds before any weight is read: a contradiction is an error naming
  both values;
- `refuse`: an error of one line naming the Meshline equivalent.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["map", "same", "check", "refuse"]
DEST_PREFIX = "megatron__"
SAME_KERNEL = "the device's fused kernel is chosen automatically (docs/kernels.md)"
"""The note of a fused-kernel switch (`--use-fused-rmsnorm`): kernels/ picks the kernel per device."""


@dataclass(frozen=True)
class CompatFlag:
    """One Megatron/ModelLink flag that is not a Meshline setting of the command."""

    flag: str
    """Main spelling, e.g. --checkpoint-activations."""
    kind: Kind
    """map, same, check or refuse (see the module docstring)."""
    note: str
    """map/same/check: what Meshline does; refuse: the equivalent."""
    nargs: int | str = 0
    """0 for a switch, 1 for one value, "*"/"+" for a list."""
    sets: tuple[tuple[str, Any], ...] = ()
    """map switches: the (setting, value) pairs the flag sets."""
    convert: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    """map flags with a value: (value, settings given so far) -> settings to set; check flags:
    (value, facts about the checkpoint) -> {} when they agree, else ValueError naming both."""
    aliases: tuple[str, ...] = ()
    """Other spellings (underscores, older names)."""
    reads_file: bool = False
    """The value is a file read at parse time (only where the caller allows it: the CLI)."""

    @property
    def dest(self) -> str:
        """Where argparse stores the flag's value."""
        return DEST_PREFIX + self.flag.lstrip("-").replace("-", "_")


def same_rows(note: str, *flags: str) -> tuple[CompatFlag, ...]:
    """`same` switches that share one note, in the order given."""
    return tuple(CompatFlag(flag, "same", note) for flag in flags)


def by_flag(rows: Iterable[CompatFlag], table: str) -> dict[str, CompatFlag]:
    """Every spelling -> its row (a spelling listed twice is a bug in `table`)."""
    out: dict[str, CompatFlag] = {}
    for row in rows:
        for name in (row.flag, *row.aliases):
            assert name not in out, f"{name} appears twice in the {table} flag table"
            out[name] = row
    return out


def add_rows(
    parser: argparse.ArgumentParser, rows: Iterable[CompatFlag], title: str, description: str
) -> None:
    """Add every row as a flag (values land under `megatron__<name>`, help says its kind)."""
    group = parser.add_argument_group(title, description)
    for row in rows:
        names = [row.flag, *row.aliases]
        help_text = f"[{row.kind}] {row.note}"
        if row.nargs == 0:
            group.add_argument(*names, dest=row.dest, action="store_true", help=help_text)
        else:
            nargs = None if row.nargs == 1 else row.nargs
            # the flag's own name as placeholder, not the prefixed dest
            metavar = row.flag.lstrip("-").upper().replace("-", "_")
            group.add_argument(*names, dest=row.dest, nargs=nargs, metavar=metavar, help=help_text)


def given(args: argparse.Namespace | dict[str, Any], rows: Iterable[CompatFlag]) -> list[Any]:
    """(row, value) for each row present in parsed `args` (a switch counts when set)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    out = []
    for row in rows:
        value = values.get(row.dest)
        if value is not None and value is not False:
            out.append((row, value))
    return out
