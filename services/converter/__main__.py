"""`python -m services.converter serve [flags]`: the converter gRPC server (`--help` lists the flags)."""

from __future__ import annotations

import argparse
import sys

from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import ServiceBinding
from services.common.service_cli import ServiceCli, service_main
from services.converter.config import DEFAULT_PORT, add_flags, from_args
from services.converter.servicer import bindings

DESCRIPTION = (
    "Convert and reshard checkpoints between HF, native and Megatron layouts, with LoRA merge "
    "and a logit parity check, as long-running operations "
    "(meshline.converter.v1.ConverterService + OperationsService)."
)


def build(args: argparse.Namespace, server_config: ServerConfig) -> list[ServiceBinding]:
    """The server's bindings from the parsed flags (ValueError names a bad flag)."""
    return bindings(from_args(args), OperationsStore(server_config.state_dir))


CLI = ServiceCli("converter", DEFAULT_PORT, DESCRIPTION, add_flags, build)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m services.converter` and `meshline serve converter`."""
    return service_main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
