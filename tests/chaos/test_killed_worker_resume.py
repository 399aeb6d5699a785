"""A training run whose worker is SIGKILLed every few steps under --max-restarts resumes each time
from its last checkpoint and ends with the loss curve of an uninterrupted run."""

from __future__ import annotations

import io
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from services.common.job_processes import find_processes
from services.common.state_db import ProcessRecord
from services.trainer.launcher import launch

pytestmark = [pytest.mark.slow, pytest.mark.dist]

FLAGS = [
    *("--model", "tiny-llama", "--mock-data", "--seq-length", "32"),
    *("--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "3e-3"),
    *("--log-interval", "1", "--eval-interval", "0", "--seed", "7"),
]


def read_latest(save: Path) -> int:
    """The step `save/latest` names (0 before the first checkpoint)."""
    try:
        return int((save / "latest").read_text().strip())
    except (OSError, ValueError):
        return 0


class WorkerKiller:
    """Kills the job's worker (not the agent) once a checkpoint at each of `at_steps` exists."""

    def __init__(self, save: Path, at_steps: list[int]) -> None:
        self.save, self.pending = save, list(at_steps)
        self.agent: ProcessRecord | None = None
        self.kills: list[int] = []
        self.kill_times: list[float] = []
        """`time.monotonic()` of each kill."""
        self.lock = threading.Lock()

    def on_started(self, record: ProcessRecord) -> None:
        self.agent = record

    def on_metrics(self, record: dict) -> None:
        with self.lock:
            if not self.pending or read_latest(self.save) < self.pending[0]:
                return
            assert self.agent is not None
            workers = psutil.Process(self.agent.pid).children()
            for worker in workers:
                worker.send_signal(signal.SIGKILL)
            if workers:
                self.kill_times.append(time.monotonic())
                self.kills.append(read_latest(self.save))
                self.pending.pop(0)


def run(
    save: Path,
    iters: int,
    killer: WorkerKiller | None,
    restarts: int,
    save_interval: int = 3,
    arrivals: list[tuple[float, int]] | None = None,
) -> dict[int, float]:
    """Trains `iters` steps into `save` (resuming from it); returns the last loss of each step.

    `arrivals`, when given, gets (`time.monotonic()`, step) of every metrics record."""
    losses: dict[int, float] = {}
    output = io.StringIO()

    def on_metrics(record: dict) -> None:
        losses[int(record["step"])] = record["loss"]
        if arrivals is not None:
            arrivals.append((time.monotonic(), int(record["step"])))
        if killer is not None:
            killer.on_metrics(record)

    flags = [*FLAGS, "--train-iters", str(iters), "--save", str(save), "--load", str(save)]
    code = launch(
        [*flags, "--save-interval", str(save_interval)],
        1,
        max_restarts=restarts,
        on_metrics=on_metrics,
        env={"OMP_NUM_THREADS": "1"},
        output=output,
        on_started=killer.on_started if killer else None,
    )
    assert code == 0, output.getvalue()[-3000:]
    return losses


def test_killed_worker_resumes_from_its_checkpoint_with_the_same_loss_curve(
    tmp_path: Path,
) -> None:
    iters = 12
    reference = run(tmp_path / "reference", iters, None, 0)
    killer = WorkerKiller(tmp_path / "chaos", [3, 6])
    interrupted = run(tmp_path / "chaos", iters, killer, 2)
    assert len(killer.kills) == 2, f"killed at checkpoints {killer.kills}"
    assert sorted(reference) == list(range(1, iters + 1))
    # Every step ran to the same loss as without the kills: the resumed state is the saved one.
    assert interrupted == reference
    assert read_latest(tmp_path / "chaos") == iters
    assert killer.agent is not None and find_processes(killer.agent.token) == []
