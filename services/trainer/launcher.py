"""Start training workers through `torch.distributed.run` (torchrun's elastic agent).

`launch()` runs `python -m torch.distributed.run ... -m services.trainer.train <flags>` as a child
process, streams its output, hands each metrics record to `on_metrics` and stops the job
gracefully when `stop_event` is set (SIGTERM to the workers, which save and exit; the agent and
then every process of the job are killed only if that overruns a grace period). The gRPC
TrainerService and `meshline train --nproc-per-node N` both use it.

Lifetime: the agent is started through `services.common.die_with_parent`, so it gets SIGTERM
(and stops its workers, which save first) when the process that launched it dies, even by
SIGKILL; every process of the job carries a job token in its environment (`job_processes`), by
which a restarted service finds and stops survivors, and `on_started` hands the caller what to
record for that. The caller's claim lock files (`pass_fds`) are inherited by the agent, so the
output claim holds for exactly as long as the job runs, even past its service.

Metrics framing: rank 0 prints `MESHLINE_METRICS <nonce> {json}` lines, with a fresh random nonce
per launch passed in $MESHLINE_METRICS_STDOUT. Only lines with that nonce are metrics; user data
echoed in the output (a path holding a newline and `MESHLINE_METRICS {`) cannot forge or break
one, and a record that does not parse is reported as output, never raised: the reader keeps
draining the job's output until the job has ended.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil
import yaml

from checkpoints.safe_fs import open_dir_beneath
from services.common.job_processes import (
    JOB_TOKEN_ENV,
    die_with_parent_command,
    find_processes,
    signal_processes,
)
from services.common.state_db import ProcessRecord, process_started
from services.trainer.train_config import TrainConfig
from services.trainer.warm_start import SPARE_ENV, SPARE_PID_ENV
from training.ckpt.signals import NO_SAVE_SIGNAL, SAVE_SIGNAL
from training.loop import METRICS_PREFIX, METRICS_STDOUT_ENV, SAVE_ON_STOP_ENV

STOP_GRACE_S = 60.0
MAX_METRICS_LINE = 1 << 16
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun settings for one job."""

    nproc_per_node: int = 1
    """Worker processes on this node."""
    nnodes: int = 1
    """Number of nodes (or MIN:MAX for elastic jobs)."""
    node_rank: int = 0
    """This node's rank (static rendezvous)."""
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous (multi-node); single node uses --standalone."""
    max_restarts: int = 0
    """Times the elastic agent restarts the workers after a failure."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if str(self.nnodes) != "1" and not self.rdzv_endpoint:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (where the nodes meet)"
            )


def torchrun_command(
    train_argv: list[str],
    options: LaunchOptions,
    entry: str = "services.trainer.train",
    static_port: int | None = None,
) -> list[str]:
    """The full command line that starts the job (`entry`: the workers' module).

    A single-node job meets through `--standalone` (c10d rendezvous on a port torchrun picks),
    or, given `static_port`, through the static rendezvous on 127.0.0.1:`static_port`: each
    restart then reuses the agent's store at once instead of a new c10d round (0.4-1 s here,
    which polls its state once a second).
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={options.nproc_per_node}",
    ]
    if options.rdzv_endpoint:
        cmd += [
            f"--nnodes={options.nnodes}",
            f"--node-rank={options.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={options.rdzv_endpoint}",
        ]
    elif static_port is not None:
        cmd += ["--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1"]
        cmd.append(f"--master-port={static_port}")
    else:
        cmd.append("--standalone")
    cmd += [f"--max-restarts={options.max_restarts}", "-m", entry, *train_argv]
    return cmd


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at this moment (for the static rendezvous' store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def warm_spare(
    directory: Path, token: str, env: dict[str, str], wanted: bool
) -> Iterator[dict[str, str]]:
    """Starts a warm spare (`services.trainer.warm_spare`) for the job when `wanted`; yields the
    environment its workers need to find it (empty without one) and stops it on exit.

    The spare carries the job token and dies with this process like the agent, so the restart
    sweep and the parent-death signal cover it and the workers it forks.
    """
    if not wanted or not sys.platform.startswith("linux"):
        yield {}
        return
    socket_path = directory / "spare.sock"
    with open(directory / "spare.log", "w") as log:
        spare = subprocess.Popen(
            die_with_parent_command(
                token,
                [sys.executable, "-m", "services.trainer.warm_spare", str(socket_path)],
                sys.executable,
            ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, JOB_TOKEN_ENV: token},
            start_new_session=True,
        )
    try:
        yield {SPARE_ENV: str(socket_path), SPARE_PID_ENV: str(spare.pid)}
    finally:
        spare.terminate()
        try:
            spare.wait(timeout=10)
        except subprocess.TimeoutExpired:
            spare.kill()
            spare.wait()


def config_argv(config: TrainConfig, directory: str | Path) -> list[str]:
    """Write `config` as YAML under `directory` and return the `--config FILE` flags for it.

    Written through `safe_fs` (beneath `directory` resolved now, atomically, never through a
    symlink), so a folder swapped after this call cannot redirect the file the workers read.
    """
    with open_dir_beneath(directory, roots=(), create=True) as opened:
        opened.write_text("train_config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
        # The workers read it through the opened folder's real path, resolved at write time.
        return ["--config", str(Path(os.path.realpath(opened.proc_path())) / "train_config.yaml")]


def launch(
    config: TrainConfig | list[str],
    nproc_per_node: int = 1,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    on_metrics: Callable[[dict[str, Any]], None] | None = None,
    stop_event: threading.Event | None = None,
    env: dict[str, str] | None = None,
    output: TextIO | None = None,
    save_on_stop: bool | Callable[[], bool] = True,
    operation: str = "",
    on_started: Callable[[ProcessRecord], None] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> int:
    """Run a training job with torchrun and wait for it; returns torchrun's exit code.

    `config` is a TrainConfig or training flags. Output lines go to `output` (default stdout),
    metrics records to `on_metrics`. Setting `stop_event` stops the workers at their next step;
    they save first when --save is given, unless `save_on_stop` is False — or, when it is a
    callable, returns False at the moment of the stop (the decision can come after the launch).
    `on_started` gets the record of the started processes (for `operation`); `pass_fds` are
    file descriptors the agent inherits (lock files that must be held while the job runs).
    """
    options = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts)
    out = output or sys.stdout
    token = secrets.token_hex(16)
    nonce = secrets.token_hex(16)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshline-launch-")))
        argv = config_argv(config, tmp) if isinstance(config, TrainConfig) else list(config)
        child_env = _child_env(env, nonce, save_on_stop, token)
        spare_env = stack.enter_context(warm_spare(tmp, token, child_env, max_restarts > 0))
        child_env.update(spare_env)
        entry = "services.trainer.warm_start" if spare_env else "services.trainer.train"
        # Restarts on one node skip the c10d round when a spare makes them otherwise fast.
        port = free_port() if spare_env and not options.rdzv_endpoint else None
        command = torchrun_command(argv, options, entry, port)
        proc = subprocess.Popen(
            die_with_parent_command(token, command, sys.executable),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=child_env,
            start_new_session=True,
            pass_fds=pass_fds,
        )
        try:
            if on_started is not None:
                started = process_started(proc.pid) or 0.0
                on_started(
                    ProcessRecord(
                        operation, "local", proc.pid, proc.pid, started, token, os.uname().nodename
                    )
                )
            prefix = f"{METRICS_PREFIX}{nonce} "
            return _follow(proc, prefix, on_metrics, out, stop_event, save_on_stop, token)
        finally:
            spare_pid = int(spare_env.get(SPARE_PID_ENV, "0"))
            leftovers = [p for p in find_processes(token) if p.pid != spare_pid]
            if proc.poll() is None or leftovers:
                # Something above raised: never leave the job running without a reader (its
                # claim is released when this returns).
                _kill_job(proc, token)


def _child_env(
    env: dict[str, str] | None, nonce: str, save_on_stop: bool | Callable[[], bool], token: str
) -> dict[str, str]:
    """The agent's environment: ours, the caller's `env`, and the job's framing and token."""
    return {
        **os.environ,
        **(env or {}),
        METRICS_STDOUT_ENV: nonce,
        SAVE_ON_STOP_ENV: "0" if save_on_stop is False else "1",
        JOB_TOKEN_ENV: token,
        "PYTHONUNBUFFERED": "1",
    }


def _follow(
    proc: subprocess.Popen,
    prefix: str,
    on_metrics: Callable[[dict[str, Any]], None] | None,
    out: TextIO,
    stop_event: threading.Event | None,
    save_on_stop: bool | Callable[[], bool],
    token: str,
) -> int:
    """Read the agent's output to its end (metrics records framed by `prefix` to `on_metrics`,
    the rest to `out`), watching `stop_event`; returns torchrun's exit code."""
    watcher = None
    if stop_event is not None:
        watcher = threading.Thread(
            target=_watch_stop, args=(proc, stop_event, save_on_stop, token), daemon=True
        )
        watcher.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            _metrics_line(line[len(prefix) :], on_metrics, out)
            continue
        out.write(line)
        out.flush()
    code = proc.wait()
    if stop_event is not None:
        stop_event.set()
        assert watcher is not None
        watcher.join()
    return code


def _metrics_line(
    text: str, on_metrics: Callable[[dict[str, Any]], None] | None, out: TextIO
) -> None:
    """Hands one framed metrics record to `on_metrics`; a bad one is reported, never raised."""
    try:
        if len(text) > MAX_METRICS_LINE:
            raise ValueError(f"longer than {MAX_METRICS_LINE} characters")
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        if on_metrics is not None:
            on_metrics(record)
    except Exception as exc:  # a bad record must not end the reading of a running job
        logger.warning("ignoring a malformed metrics record: %s: %s", type(exc).__name__, exc)
        out.write(f"(malformed metrics record ignored: {type(exc).__name__}: {exc})\n")


def _kill_job(proc: subprocess.Popen, token: str) -> None:
    """SIGKILL to the agent and every process carrying the job token; waits for the agent."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    signal_processes(find_processes(token), signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)


def _watch_stop(
    proc: subprocess.Popen,
    stop_event: threading.Event,
    save_on_stop: bool | Callable[[], bool],
    token: str,
) -> None:
    """On stop: signal the workers (not the agent, which would report the job as failed).

    SIGTERM asks each worker to finish its step, save (with --save) and exit 0, so torchrun ends
    cleanly; SIGUSR2 does the same without the save. If that takes longer than STOP_GRACE_S the
    agent is terminated, then every process of the job killed (the workers run in sessions of
    their own, so the agent's process group does not reach them).
    """
    stop_event.wait()
    if proc.poll() is not None:
        return
    save = save_on_stop() if callable(save_on_stop) else save_on_stop
    signum = SAVE_SIGNAL if save else NO_SAVE_SIGNAL
    for child in psutil.Process(proc.pid).children(recursive=False):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signum)
    try:
        proc.wait(timeout=STOP_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_job(proc, token)
