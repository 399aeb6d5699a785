"""Settings of the preprocess gRPC service (the server's own; request fields live in the proto)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.common.data_roots import DataRootsConfig
from services.common.service_flags import add_service_flags, service_config

DEFAULT_PORT = 50051


@dataclass
class PreprocessServiceConfig(DataRootsConfig):
    """What a preprocess server may touch (inputs, tokenizer and output prefix lie under
    `data_roots`) and how much it may use."""

    max_workers: int = max(1, os.cpu_count() or 1)
    """Largest `workers` a request may ask for (tokeniser processes per job; default: the CPU
    count)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_workers < 1:
            raise ValueError(f"--max-workers must be >= 1, got {self.max_workers}")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the preprocess service's own flags to its `serve` parser."""
    add_service_flags(
        parser, PreprocessServiceConfig, "preprocess service", "request paths", ("max_workers",)
    )


def from_args(args: argparse.Namespace) -> PreprocessServiceConfig:
    """Builds (and so validates) the config from the flags `add_flags` added."""
    return service_config(args, PreprocessServiceConfig)
