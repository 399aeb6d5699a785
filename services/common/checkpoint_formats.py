"""The one map between the proto enum `meshline.common.v1.CheckpointFormat` and the registry keys
of checkpoints/registry.py: CHECKPOINT_FORMAT_<KEY> <-> "key" (CHECKPOINT_FORMAT_HF <-> "hf").

Servicers turn request enums into registry keys here and nowhere else;
tests/checkpoints/test_registry.py checks that the enum and the registry name the same formats.
"""

from __future__ import annotations

from checkpoints.registry import FORMATS
from meshline.common.v1 import checkpoint_pb2

PREFIX = "CHECKPOINT_FORMAT_"
Enum = checkpoint_pb2.CheckpointFormat

KEYS: dict[checkpoint_pb2.CheckpointFormat, str] = {
    number: name.removeprefix(PREFIX).lower()
    for name, number in Enum.items()
    if number != checkpoint_pb2.CHECKPOINT_FORMAT_UNSPECIFIED
    and name.removeprefix(PREFIX).lower() in FORMATS
}
"""Enum value -> registry key, for every value the registry knows."""
VALUES: dict[str, checkpoint_pb2.CheckpointFormat] = {key: number for number, key in KEYS.items()}
"""Registry key -> enum value."""


def format_names(keys: tuple[str, ...], conjunction: str = "or") -> str:
    """'HF, NATIVE or MEGATRON': the enum spellings of `keys` for messages (prefix dropped)."""
    names = [key.upper() for key in keys]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def format_keys(keys: tuple[str, ...]) -> dict[checkpoint_pb2.CheckpointFormat, str]:
    """Enum value -> registry key, restricted to `keys` (e.g. the formats served)."""
    return {VALUES[key]: key for key in keys}
