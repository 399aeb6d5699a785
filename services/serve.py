"""`meshline serve <service> [flags]` and `meshline serve all`: run Meshline's gRPC services.

`meshline serve inference --port 0` is `python -m services.inference serve --port 0`. `serve all`
starts the five services as five child processes (one per service, as in a Kubernetes
deployment, so a crash or a heavy import in one never takes the others down) on consecutive
ports from `--base-port`, turns SIGINT/SIGTERM into one SIGTERM per child and exits once every
child has stopped: 0 if all stopped cleanly, else the first failing child's exit code. Children
run in their own sessions and, on Linux, get SIGTERM if the parent dies.

Each service's `__main__` builds its CLI with `service_main`, so all five share one shape.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import signal
import subprocess
import sys
import time
from types import FrameType

from services.cli import SERVICES
from services.common.config import ServerConfig

DEFAULT_BASE_PORT = 50051
# Child processes get this long after the stop signal before they are killed; a child's own
# graceful stop (`--grace-period`) should fit inside it.
CHILD_STOP_TIMEOUT_S = 60.0
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1
# Torch-free checks a service runs on its flags before it is imported: module with
# `precheck(argv) -> exit code | None`.
PRECHECKS = {"inference": "services.inference.precheck"}
SECURITY_FILE_FLAGS = {
    "--auth-token-file": "bearer token file every service requires (default: no authentication)",
    "--tls-cert": "PEM certificate chain every service listens with (enables TLS)",
    "--tls-key": "PEM private key for --tls-cert",
    "--tls-client-ca": "PEM CA client certificates must chain to (mTLS; needs --tls-cert)",
}


def _all_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshline serve all",
        description="Run all five services as child processes on consecutive ports from "
        "--base-port (" + ", ".join(f"{n} +{i}" for i, n in enumerate(SERVICES)) + "). "
        "SIGINT/SIGTERM stops them all. The inference service starts without a model; run "
        "`meshline serve inference --load DIR` separately to serve one.",
        allow_abbrev=False,
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface every service binds")
    parser.add_argument(
        "--base-port",
        type=int,
        default=DEFAULT_BASE_PORT,
        help=f"port of the first service; the others follow (default {DEFAULT_BASE_PORT})",
    )
    parser.add_argument(
        "--data-root",
        dest="data_roots",
        action="append",
        default=[],
        metavar="DIR",
        help="directory request paths must lie under, passed to every job service; repeatable "
        "(default: the current directory)",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help="operation records persist under STATE_DIR/<service> (default: memory only)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument(
        "--metrics-base-port",
        type=int,
        default=None,
        help="serve each service's Prometheus /metrics on consecutive ports from this one, in "
        "the same order as the gRPC ports (default: off)",
    )
    # Passed to every child unchanged: each service validates and applies them as it would when
    # started alone (`services.common.config`), and `serve all` checks them first (below).
    for flag, help_text in SECURITY_FILE_FLAGS.items():
        parser.add_argument(flag, default=None, metavar="FILE", help=help_text)
    parser.add_argument(
        "--metrics-secure",
        action="store_true",
        default=False,
        help="serve every /metrics with the services' --tls-cert/--tls-key (HTTPS, mTLS with "
        "--tls-client-ca) and require the --auth-token-file token (needs --metrics-base-port)",
    )
    return parser


def _check_security(args: argparse.Namespace) -> str | None:
    """The first error in the TLS/auth flags, as `serve all` spells them; None when they hold."""
    if args.metrics_secure and args.metrics_base_port is None:
        return "--metrics-secure needs --metrics-base-port (the endpoints it secures)"
    try:
        ServerConfig(
            auth_token_file=args.auth_token_file,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            metrics_port=0 if args.metrics_base_port is not None else None,
            metrics_secure=args.metrics_secure,
        )
    except ValueError as exc:
        return str(exc)
    return None


def child_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The `python -m services.<name> serve ...` command line of each service."""
    commands = {}
    for offset, name in enumerate(SERVICES):
        command = [sys.executable, "-m", f"services.{name}", "serve"]
        command += ["--host", args.host, "--port", str(args.base_port + offset)]
        command += ["--log-level", args.log_level]
        if args.metrics_base_port is not None:
            command += ["--metrics-port", str(args.metrics_base_port + offset)]
        if args.state_dir:
            command += ["--state-dir", f"{args.state_dir}/{name}"]
        for flag in SECURITY_FILE_FLAGS:
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is not None:
                command += [flag, value]
        if args.metrics_secure:
            command.append("--metrics-secure")
        if name != "inference":
            for root in args.data_roots:
                command += ["--data-root", root]
        commands[name] = command
    return commands


def _stop_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM if the parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_all(children: dict[str, subprocess.Popen]) -> None:
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
    for name, child in children.items():
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"meshline serve all: {name} did not stop in time; killing it", file=sys.stderr)
            child.kill()
            child.wait()


def serve_all(argv: list[str]) -> int:
    """Runs the five services as child processes until a signal or until one of them exits."""
    args = _all_parser().parse_args(argv)
    if not 1 <= args.base_port <= 65535 - (len(SERVICES) - 1):
        print(
            f"meshline serve all: --base-port must be in [1, {65535 - len(SERVICES) + 1}], "
            f"got {args.base_port}",
            file=sys.stderr,
        )
        return 2
    if args.metrics_base_port is not None and not (
        1 <= args.metrics_base_port <= 65535 - (len(SERVICES) - 1)
    ):
        print(
            f"meshline serve all: --metrics-base-port must be in "
            f"[1, {65535 - len(SERVICES) + 1}], got {args.metrics_base_port}",
            file=sys.stderr,
        )
        return 2
    if (error := _check_security(args)) is not None:
        print(f"meshline serve all: {error}", file=sys.stderr)
        return 2
    stop: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: dict[str, subprocess.Popen] = {}
    failed: tuple[str, int] | None = None
    try:
        for offset, (name, command) in enumerate(child_commands(args).items()):
            # Own sessions: a terminal's Ctrl-C reaches only this parent, which then stops each
            # child exactly once (a second signal could land after a child's handlers are gone).
            children[name] = subprocess.Popen(
                command, start_new_session=True, preexec_fn=_stop_with_parent
            )
            print(
                f"meshline serve all: started {name} on {args.host}:{args.base_port + offset} "
                f"(pid {children[name].pid})",
                flush=True,
            )
        while not stop and failed is None:
            for name, child in children.items():
                if child.poll() is not None:
                    failed = (name, child.returncode)
                    break
            time.sleep(_POLL_S)
    finally:
        _stop_all(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is not None:
        name, code = failed
        print(
            f"meshline serve all: {name} exited with code {code}; stopped the others "
            f"(its own error is above)",
            file=sys.stderr,
        )
        return code or 1
    bad = {name: child.returncode for name, child in children.items() if child.returncode != 0}
    if bad:
        print(f"meshline serve all: services stopped with errors: {bad}", file=sys.stderr)
        return 1
    print("meshline serve all: all services stopped", flush=True)
    return 0


def _usage() -> str:
    return (
        "usage: meshline serve <service> [flags]   (meshline serve <service> --help)\n"
        "       meshline serve all [--host H] [--base-port P] [--data-root DIR] [--state-dir D]\n\n"
        f"services: {', '.join(SERVICES)}"
    )


def main(argv: list[str] | None = None) -> int:
    """`meshline serve <service>|all [flags]`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "all":
        return serve_all(rest)
    if name not in SERVICES:
        print(f"meshline serve: unknown service {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in PRECHECKS:
        # Before the service's import (torch, for inference): a layout its config rules out is
        # refused in well under a second.
        code = importlib.import_module(PRECHECKS[name]).precheck(rest)
        if code is not None:
            return int(code)
    module = importlib.import_module(f"services.{name}.__main__")
    return int(module.main(["serve", *rest]))


if __name__ == "__main__":
    sys.exit(main())
