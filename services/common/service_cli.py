"""`python -m services.<name> serve`: the argument parser and main shared by every service.

Each stage's `__main__.py` describes itself with a `ServiceCli` and calls `service_main`; `meshline
serve all` (services/serve.py) starts every stage as a child running that same entry point.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import ServerConfig, add_server_flags, server_config_from_args
from services.common.logging import setup_logging
from services.common.server import ServiceBinding, run


@dataclass(frozen=True)
class ServiceCli:
    """What `python -m services.<name> serve` needs to know about one service."""

    name: str
    """Service folder name, e.g. "inference"."""
    default_port: int
    """Port used when --port is not given."""
    description: str
    """One paragraph shown by --help."""
    add_flags: Callable[[argparse.ArgumentParser], None]
    """Adds the service's own flags to the serve parser."""
    build: Callable[[argparse.Namespace, ServerConfig], list[ServiceBinding]]
    """Builds the service config from the parsed flags and returns the server's bindings given the
    common ServerConfig; raises ValueError naming a bad flag."""


def build_parser(spec: ServiceCli) -> argparse.ArgumentParser:
    """`python -m services.<name>` parser: one `serve` subcommand with server + service flags."""
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{spec.name}", description=spec.description, allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="serve")
    serve = commands.add_parser(
        "serve",
        help=f"run the {spec.name} gRPC server until SIGINT/SIGTERM",
        description=f"{spec.description} Prints 'serving <services> on HOST:PORT' once listening.",
        allow_abbrev=False,
    )
    add_server_flags(serve, spec.default_port)
    spec.add_flags(serve)
    return parser


def service_main(spec: ServiceCli, argv: list[str] | None = None) -> int:
    """Parses `serve [flags]`, builds the service and runs it until a stop signal."""
    args = build_parser(spec).parse_args(sys.argv[1:] if argv is None else argv)
    prog = f"{spec.name} serve"
    try:
        server_config = server_config_from_args(args)
        # Before the build: loading a model logs what it chose (layouts, decode step, devices).
        setup_logging(server_config.log_level, server_config.log_format)
        bindings = spec.build(args, server_config)
    except (ValueError, NotImplementedError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return run(bindings, server_config)
