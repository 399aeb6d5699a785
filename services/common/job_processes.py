"""Processes a job starts outside its server: marked, tied to the server's life, found again.

Every process of a job carries `JOB_TOKEN_ENV=<token>` in its environment (children inherit it,
torchrun passes it on to its workers even though it starts them in new sessions), so the job's
whole tree can be found from outside by that token, whatever process groups it made
(`find_processes`). The launcher process is started through `die_with_parent` (`python -m
services.common.die_with_parent TOKEN -- CMD...`), which sets the Linux parent-death signal
before exec: when the server dies, even by SIGKILL, the launcher gets SIGTERM and stops its
workers (torchrun: SIGTERM to each worker, which checkpoints and exits; SIGKILL after its
timeout). A restarted server stops whatever still carries the token of an operation its
predecessor left unfinished (`stop_processes`) before it releases that operation's claims.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

import psutil

from services.common.state_db import ProcessRecord

logger = logging.getLogger(__name__)

JOB_TOKEN_ENV = "MESHLINE_JOB_TOKEN"
STOP_GRACE_S = 15.0
PR_SET_PDEATHSIG = 1


def die_with_parent_here(parent: int, signum: int = signal.SIGTERM) -> bool:
    """Makes this process get `signum` when its parent thread dies (Linux `PR_SET_PDEATHSIG`).

    False when the parent is no longer `parent` (it died before the call, so the signal would
    never come: the caller should exit) ; True elsewhere, where only the restart sweep guards.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == parent


def die_with_parent_command(token: str, command: Sequence[str], python: str) -> list[str]:
    """`command` wrapped so it gets SIGTERM when the calling thread's process dies."""
    return [
        python,
        "-m",
        "services.common.die_with_parent",
        str(os.getpid()),
        token,
        "--",
        *command,
    ]


def find_processes(token: str) -> list[psutil.Process]:
    """Every live process of this user whose environment carries job token `token`."""
    if not token:
        return []
    found = []
    uid = os.getuid()
    for proc in psutil.process_iter(["uids", "status"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            if proc.environ().get(JOB_TOKEN_ENV) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def signal_processes(processes: Sequence[psutil.Process], signum: int) -> None:
    """Sends `signum` to each process that is still there."""
    for proc in processes:
        try:
            proc.send_signal(signum)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def stop_processes(token: str, grace_s: float = STOP_GRACE_S) -> tuple[int, int]:
    """Stops every process of job `token`: SIGTERM, then SIGKILL after `grace_s`.

    Returns (found, killed): how many were alive, and how many needed SIGKILL. Waits until all
    are gone, so the caller may release what they held.
    """
    found = find_processes(token)
    if not found:
        return 0, 0
    signal_processes(found, signal.SIGTERM)
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    # Workers a launcher restarted in the meantime carry the token too.
    stragglers = {p.pid: p for p in [*alive, *find_processes(token)]}
    deadline = time.monotonic() + 10.0
    killed = 0
    while stragglers and time.monotonic() < deadline:
        killed += len(stragglers)
        signal_processes(list(stragglers.values()), signal.SIGKILL)
        psutil.wait_procs(list(stragglers.values()), timeout=2.0)
        stragglers = {p.pid: p for p in find_processes(token)}
    if stragglers:
        logger.error("job %s: processes %s did not die", token, sorted(stragglers))
    return len(found), killed


def stop_local(record: ProcessRecord) -> str:
    """Stops a local job's processes (`stop_processes`); says what it found, for the record."""
    found, killed = stop_processes(record.token)
    if not found:
        return "its processes had already ended with the server"
    how = f" ({killed} with SIGKILL)" if killed else ""
    return f"{found} of its processes were still running and were stopped{how}"
