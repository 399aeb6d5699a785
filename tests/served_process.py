"""A server process as a user launches it, for tests: its output read on a thread, the ports it
announces parsed from that output, SIGTERM (then kill) when the `with` block ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRPC_PORT = re.compile(r"serving \S+ on 127\.0\.0\.1:(\d+)")
HTTP_PORT = re.compile(r"OpenAI-compatible HTTP API on http://127\.0\.0\.1:(\d+)/v1")
METRICS_PORT = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")


@dataclass
class Launched:
    """A running server process."""

    process: subprocess.Popen[str]
    """The process (stdout and stderr merged into `lines`)."""
    lines: list[str] = field(default_factory=list)
    """Its output so far."""
    ports: dict[str, int] = field(default_factory=dict)
    """Announced ports by pattern name."""

    def tail(self, count: int = 30) -> str:
        """The last `count` lines of output, for assertion messages."""
        return "".join(self.lines[-count:])


@contextmanager
def launched(
    command: list[str],
    patterns: dict[str, re.Pattern[str]],
    ready_s: float = 300,
    env: dict[str, str] | None = None,
) -> Iterator[Launched]:
    """Run `command` from the repository root until every pattern's port is announced (an
    AssertionError with the output's tail if the process ends or `ready_s` passes first);
    `env` replaces the inherited environment."""
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
    )
    server = Launched(process)
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            server.lines.append(line)
            for name, pattern in patterns.items():
                if (match := pattern.search(line)) and name not in server.ports:
                    server.ports[name] = int(match[1])
            if len(server.ports) == len(patterns):
                ready.set()
        ready.set()  # the process ended: stop waiting

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(ready_s) and len(server.ports) == len(patterns), server.tail()
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
