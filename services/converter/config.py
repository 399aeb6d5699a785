"""Settings of the converter gRPC service (the server's own; request fields live in the proto)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.data_roots import DataRootsConfig
from services.common.service_flags import add_service_flags, service_config

DEFAULT_PORT = 50053


@dataclass
class ConverterServiceConfig(DataRootsConfig):
    """What a converter server may touch (checkpoint paths in requests — load, save, LoRA — lie
    under `data_roots`) and how far it may reshard."""

    max_parallel_size: int = 64
    """Largest target tensor- or pipeline-parallel size a request may ask for (default 64)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_parallel_size < 1:
            raise ValueError(f"--max-parallel-size must be >= 1, got {self.max_parallel_size}")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the converter service's own flags to its `serve` parser."""
    add_service_flags(
        parser,
        ConverterServiceConfig,
        "converter service",
        "checkpoint paths",
        ("max_parallel_size",),
    )


def from_args(args: argparse.Namespace) -> ConverterServiceConfig:
    """Builds (and so validates) the config from the flags `add_flags` added."""
    return service_config(args, ConverterServiceConfig)
