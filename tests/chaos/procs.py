"""Services as real processes for the chaos tests: start on a state dir, kill -9, restart, and
look at what they left from outside (processes, files, the state database)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import psutil

from services.common.claims import lock_path

ROOT = Path(__file__).resolve().parents[2]
SERVING_LINE = re.compile(r"serving (?P<names>.+) on (?P<host>\S+):(?P<port>\d+)")
T = TypeVar("T")


@dataclass
class Service:
    """One service process started from its CLI; its output drained by a thread."""

    name: str
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    port: int = 0

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            match = SERVING_LINE.search(line)
            if match and not self.ready.is_set():
                self.port = int(match["port"])
                self.ready.set()
        self.ready.set()

    def channel(self) -> grpc.Channel:
        """A channel to the service, once it is ready."""
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        return channel

    def descendants(self) -> list[psutil.Process]:
        """Every live process the service started, directly or not."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill9(self) -> list[psutil.Process]:
        """SIGKILL to the service alone (not its children); returns its descendants before."""
        before = self.descendants()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        return before

    def stop(self) -> None:
        """Kills the service if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def log(self) -> str:
        """Its last output lines (for assertion messages)."""
        return "\n".join(self.lines[-40:])


def start_service(name: str, data_root: Path | None, state_dir: Path, *extra: str) -> Service:
    """Starts `python -m services.<name> serve` on a free port; waits until it serves.

    `data_root` None: no --data-root (inference takes one only for run-time LoRA adapters)."""
    command = [sys.executable, "-m", f"services.{name}", "serve", "--port", "0"]
    command += ["--grace-period", "5"]
    if data_root is not None:
        command += ["--data-root", str(data_root)]
    command += ["--state-dir", str(state_dir), *extra]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    service = Service(name, process)
    threading.Thread(target=service._read, daemon=True).start()
    assert service.ready.wait(120), f"{name} never logged its port"
    assert service.port, f"{name} exited before serving:\n{service.log()}"
    return service


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (zombies count as gone)."""
    running = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            continue
    return running


def wait_for(check: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """Polls `check` until it returns something truthy; AssertionError naming `what` after."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)


def db_rows(state_dir: Path, query: str) -> list[tuple]:
    """Rows of `query` against the service's state database, read from outside (read-only)."""
    uri = f"file:{state_dir / 'meshline-state.sqlite3'}?mode=ro"
    with sqlite3.connect(uri, uri=True, timeout=30) as db:
        return db.execute(query).fetchall()


def lock_is_free(output: Path) -> bool:
    """Whether no process holds the claim lock of `output` (tries it, then lets go)."""
    lock = lock_path(output)
    if not lock.exists():
        return True
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
