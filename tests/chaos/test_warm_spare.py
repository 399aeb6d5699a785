"""The warm spare (services.trainer.warm_spare) and its thin workers (warm_start), as real
processes: a forked worker trains and exits like a cold one, never outlives its thin worker,
and never trains beside a newer worker of its rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.trainer.warm_start import SPARE_ENV, SPARE_PID_ENV
from tests.chaos.procs import ROOT, alive, wait_for

pytestmark = pytest.mark.slow

FLAGS = [
    *("--model", "tiny-llama", "--mock-data", "--seq-length", "32"),
    *("--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "3e-3"),
    *("--log-interval", "1", "--eval-interval", "0", "--seed", "7"),
]


@pytest.fixture(scope="module")
def spare(tmp_path_factory: pytest.TempPathFactory):
    """A running spare; yields (its process, the environment thin workers need)."""
    folder = tmp_path_factory.mktemp("spare")
    socket_path = folder / "spare.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.trainer.warm_spare", str(socket_path)],
        cwd=ROOT,
        env=env,
    )
    wait_for(socket_path.exists, 120, "the spare's socket")
    yield process, {**env, SPARE_ENV: str(socket_path), SPARE_PID_ENV: str(process.pid)}
    process.kill()
    process.wait(30)


def thin_worker(env: dict[str, str], *flags: str, rank: str = "0") -> subprocess.Popen:
    """`python -m services.trainer.warm_start FLAGS` as torchrun would start it."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.trainer.warm_start", *FLAGS, *flags],
        cwd=ROOT,
        env={**env, "LOCAL_RANK": rank},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def forked_workers(spare: subprocess.Popen) -> list[psutil.Process]:
    """The spare's live children (the workers it forked)."""
    return alive(psutil.Process(spare.pid).children())


def test_a_forked_worker_trains_and_exits_like_a_cold_one(spare, tmp_path: Path) -> None:
    process, env = spare
    done = thin_worker(env, "--train-iters", "3", "--save", str(tmp_path / "ckpt"))
    out, _ = done.communicate(timeout=120)
    assert done.returncode == 0, out
    assert "training finished" in out and (tmp_path / "ckpt" / "latest").read_text().strip() == "3"
    # A user error comes back with the cold worker's exit code and message.
    bad = thin_worker(env, "--train-iters", "-1")
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 2, out
    assert "meshline train:" in out
    assert wait_for(lambda: not forked_workers(process), 10, "the workers to be reaped")


def test_killing_the_thin_worker_kills_its_forked_worker(spare, tmp_path: Path) -> None:
    process, env = spare
    thin = thin_worker(env, "--train-iters", "1000000")
    assert thin.stdout is not None
    while not thin.stdout.readline().startswith("step "):
        assert thin.poll() is None, "the worker ended before training"
    (worker,) = forked_workers(process)
    thin.send_signal(signal.SIGKILL)
    thin.wait(30)
    # Gone by itself (it watches the connection), not only at the next request.
    assert wait_for(lambda: not alive([worker]), 10, "the forked worker to die")


def test_a_new_worker_of_a_rank_replaces_the_old_one(spare, tmp_path: Path) -> None:
    process, env = spare
    old = thin_worker(env, "--train-iters", "1000000")
    assert old.stdout is not None
    while not old.stdout.readline().startswith("step "):
        assert old.poll() is None, "the worker ended before training"
    (old_worker,) = forked_workers(process)
    new = thin_worker(env, "--train-iters", "1000000")
    assert new.stdout is not None
    while not new.stdout.readline().startswith("step "):
        assert new.poll() is None, "the new worker ended before training"
    assert not alive([old_worker])
    # The old thin worker dies as its worker did: by SIGKILL.
    assert old.wait(30) == -signal.SIGKILL
    # SIGTERM to a thin worker reaches its worker, which stops at a step and exits 0.
    started = time.monotonic()
    new.send_signal(signal.SIGTERM)
    out = new.communicate(timeout=60)[0]
    assert new.returncode == 0, out
    assert "stopped early" in out, out
    assert time.monotonic() - started < 60
