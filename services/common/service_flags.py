"""The `serve` flags of a job service's own config dataclass, derived from it.

Every job service's config inherits `DataRootsConfig` and adds a few limits (`max_workers`,
`max_parallel_size`, ...). Its `serve` flags are `--data-root` plus one flag per listed field,
named, typed and documented by the dataclass (services/common/dataclass_flags.py), and the config
is built back from them in one call, so a service's config.py lists names, not flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import TypeVar

from services.common.data_roots import DataRootsConfig, add_data_root_flag, data_roots_from_args
from services.common.dataclass_flags import FlagSpec, add_fields, config_values

ConfigT = TypeVar("ConfigT", bound=DataRootsConfig)


def add_service_flags(
    parser: argparse.ArgumentParser,
    cls: type[DataRootsConfig],
    title: str,
    paths: str,
    names: Iterable[str],
    specs: Mapping[str, FlagSpec] | None = None,
) -> None:
    """A `title` argument group with `--data-root` (which `paths` must lie under) and the flags
    of `cls`'s fields `names`."""
    group = parser.add_argument_group(title)
    add_data_root_flag(group, paths)
    add_fields(group, cls, names, specs)


def service_config(args: argparse.Namespace, cls: type[ConfigT]) -> ConfigT:
    """Builds (and so validates) `cls` from the flags `add_service_flags` added."""
    values = config_values(args, cls)
    values["data_roots"] = data_roots_from_args(args)
    return cls(**values)
