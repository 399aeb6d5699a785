"""`python -m services.trainer serve [flags]`: the trainer gRPC server (`--help` lists the flags)."""

from __future__ import annotations

import argparse
import sys

from services.common.config import ServerConfig
from services.common.operations import OperationsStore
from services.common.server import ServiceBinding
from services.common.service_cli import ServiceCli, service_main
from services.trainer.config import DEFAULT_PORT, add_flags, from_args
from services.trainer.k8s_launcher import stop_recorded_workload
from services.trainer.servicer import bindings

DESCRIPTION = (
    "Launch, stop and watch training jobs that take `meshline train`'s Megatron-style flags, as "
    "long-running operations (meshline.trainer.v1.TrainerService + OperationsService)."
)


def build(args: argparse.Namespace, server_config: ServerConfig) -> list[ServiceBinding]:
    """The server's bindings from the parsed flags (ValueError names a bad flag)."""
    # A restarted trainer stops the workloads its predecessor left running in the cluster.
    stoppers = {"kubernetes": stop_recorded_workload}
    return bindings(from_args(args), OperationsStore(server_config.state_dir, stoppers=stoppers))


CLI = ServiceCli("trainer", DEFAULT_PORT, DESCRIPTION, add_flags, build)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m services.trainer` and `meshline serve trainer`."""
    return service_main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
