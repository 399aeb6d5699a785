"""`python -m services.inference serve [flags]`: the inference gRPC server (`--help` lists the flags).

Without `--load` the server starts with no model: health SERVING, request validation active, and
every model RPC answering FAILED_PRECONDITION "no model loaded; start the server with --load DIR".
"""

from __future__ import annotations

import argparse
import sys

from kernels.cpu.threads import apply_torch_threads
from services.common.config import ServerConfig
from services.common.server import ServiceBinding
from services.common.service_cli import ServiceCli, service_main
from services.inference.config import (
    DEFAULT_PORT,
    add_flags,
    check_weight_update_auth,
    from_args,
)
from services.inference.http_config import add_http_flags, http_config_from_args
from services.inference.servicer import bindings, load_engine

DESCRIPTION = (
    "Generate, stream, score and tokenize with the checkpoint given to --load "
    "(meshline.inference.v1.InferenceService)."
)


def build(args: argparse.Namespace, server_config: ServerConfig) -> list[ServiceBinding]:
    """The server's bindings from the parsed flags; loads the model when --load is given."""
    config = from_args(args)
    apply_torch_threads()  # the cgroup quota / affinity mask, not the host's core count
    check_weight_update_auth(config, server_config.auth_token_file)
    http = http_config_from_args(args)
    runtime_lora = server_config.auth_token_file is not None
    return bindings(config, load_engine(config), http, runtime_lora)


def add_all_flags(parser: argparse.ArgumentParser) -> None:
    """The service's flags and those of its OpenAI-compatible HTTP front."""
    add_flags(parser)
    add_http_flags(parser)


CLI = ServiceCli("inference", DEFAULT_PORT, DESCRIPTION, add_all_flags, build)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m services.inference` and `meshline serve inference`."""
    return service_main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
