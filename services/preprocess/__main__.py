"""`python -m services.preprocess serve [flags]`: the preprocess gRPC server (`--help` lists the flags)."""

from __future__ import annotations

import argparse
import sys

from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import ServiceBinding
from services.common.service_cli import ServiceCli, service_main
from services.preprocess.config import DEFAULT_PORT, add_flags, from_args
from services.preprocess.servicer import bindings

DESCRIPTION = (
    "Tokenise corpora and instruction data into Megatron .bin/.idx or Arrow shards on shared "
    "storage, as long-running operations (meshline.preprocess.v1.PreprocessService + "
    "OperationsService)."
)


def build(args: argparse.Namespace, server_config: ServerConfig) -> list[ServiceBinding]:
    """The server's bindings from the parsed flags (ValueError names a bad flag)."""
    return bindings(from_args(args), OperationsStore(server_config.state_dir))


CLI = ServiceCli("preprocess", DEFAULT_PORT, DESCRIPTION, add_flags, build)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m services.preprocess` and `meshline serve preprocess`."""
    return service_main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
