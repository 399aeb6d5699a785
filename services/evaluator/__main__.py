"""`python -m services.evaluator serve [flags]`: the evaluator gRPC server (`--help` lists the flags)."""

from __future__ import annotations

import argparse
import sys

from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import ServiceBinding
from services.common.service_cli import ServiceCli, service_main
from services.evaluator.config import DEFAULT_PORT, add_flags, from_args
from services.evaluator.servicer import bindings

DESCRIPTION = (
    "Score a model on benchmark tasks through an inference endpoint or a local checkpoint, as "
    "long-running operations (meshline.evaluator.v1.EvaluatorService + OperationsService)."
)


def build(args: argparse.Namespace, server_config: ServerConfig) -> list[ServiceBinding]:
    """The server's bindings from the parsed flags (ValueError names a bad flag)."""
    return bindings(from_args(args), OperationsStore(server_config.state_dir))


CLI = ServiceCli("evaluator", DEFAULT_PORT, DESCRIPTION, add_flags, build)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m services.evaluator` and `meshline serve evaluator`."""
    return service_main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
