"""Worker entry point under a warm spare: `torchrun ... -m services.trainer.warm_start <flags>`.

Imports nothing heavy. Connects to the warm spare named by $MESHLINE_WARM_SPARE
(`services.trainer.warm_spare`), hands it this process's argv, environment, working folder and
stdin/stdout/stderr, and stands in for the forked worker: signals it gets (SIGTERM, SIGUSR2,
SIGINT, SIGHUP) go to the worker, and it exits as the worker did, so torchrun watches, signals
and restarts it exactly as it would a cold worker. Killing it kills the worker (which watches
the connection). Without a spare (the variable unset, the spare gone or not ready within
SPARE_WAIT_S) it runs `services.trainer.train` in this process: a cold start, slower, the same
result.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time

SPARE_ENV = "MESHLINE_WARM_SPARE"
SPARE_PID_ENV = "MESHLINE_WARM_SPARE_PID"
SPARE_WAIT_S = 300.0
FORWARDED = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


def _spare_alive() -> bool:
    try:
        pid = int(os.environ.get(SPARE_PID_ENV, "0"))
        if pid > 0:
            os.kill(pid, 0)
            return True
    except (ValueError, OSError):
        pass
    return False


def connect() -> socket.socket | None:
    """A connection to the spare, waiting while it still imports; None when there is none."""
    path = os.environ.get(SPARE_ENV)
    if not path:
        return None
    deadline = time.monotonic() + SPARE_WAIT_S
    while time.monotonic() < deadline and _spare_alive():
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            time.sleep(0.05)
    return None


def run_in_spare(conn: socket.socket, argv: list[str]) -> int:
    """Starts the worker in the spare and waits for it; returns its exit code (or dies alike)."""
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg(
        [struct.pack("!I", len(body))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())]
    )
    conn.sendall(body)
    reader = conn.makefile("r", encoding="ascii")
    first = reader.readline().split()
    if len(first) != 2 or first[0] != "pid":
        print("meshline train: the warm spare did not start a worker", file=sys.stderr)
        return 1
    worker = int(first[1])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    line = reader.readline()  # retried across forwarded signals (PEP 475)
    kind, _, value = line.strip().partition(" ")
    if kind == "exit" and value.lstrip("-").isdigit():
        return int(value)
    if kind == "signal" and value.isdigit():
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    print(f"meshline train: the worker in the warm spare ended without a status ({line!r})")
    return 1


def main() -> int:
    """Runs the worker in the spare, or here when there is no spare."""
    argv = sys.argv[1:]
    conn = connect()
    if conn is None:
        if os.environ.get(SPARE_ENV):
            print("meshline train: no warm spare answered; starting a cold worker", flush=True)
        # A cold worker only: with a spare, this thin process must start without importing torch.
        from services.trainer.train import main as train_main

        return train_main(argv)
    return run_in_spare(conn, argv)


if __name__ == "__main__":
    sys.exit(main())
