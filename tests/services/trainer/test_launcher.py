"""Launching through torchrun: 2 real gloo workers, metrics streamed back, graceful stop + save."""

from __future__ import annotations

import io
import json
import threading

import psutil
import pytest

from services.common.job_processes import find_processes
from services.common.state_db import ProcessRecord
from services.trainer import cli
from services.trainer.arguments import parse_args
from services.trainer.launcher import LaunchOptions, launch, torchrun_command

FLAGS = [
    "--model",
    "tiny-llama",
    "--mock-data",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--log-interval",
    "2",
    "--eval-interval",
    "0",
]


def test_torchrun_command_and_options():
    cmd = torchrun_command(["--lr", "1"], LaunchOptions(nproc_per_node=2, max_restarts=3))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd and "--max-restarts=3" in cmd
    assert cmd[-4:] == ["-m", "services.trainer.train", "--lr", "1"]
    multi = torchrun_command([], LaunchOptions(nproc_per_node=1, nnodes=2, rdzv_endpoint="h:29400"))
    assert "--rdzv-endpoint=h:29400" in multi and "--nnodes=2" in multi
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        LaunchOptions(nnodes=2)


def test_cli_checks_flags_before_launching(capsys):
    code = cli.main(
        [
            "--nproc-per-node",
            "2",
            "--model",
            "tiny-llama",
            "--mock-data",
            "--global-batch-size",
            "3",
        ]
    )
    assert code == 2
    assert "--global-batch-size 3" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.slow
def test_two_workers_stream_metrics_and_stop_gracefully(tmp_path):
    records: list[dict] = []
    stop = threading.Event()

    def on_metrics(record: dict) -> None:
        records.append(record)
        if record["step"] >= 4:
            stop.set()

    config = parse_args(
        [
            *FLAGS,
            "--train-iters",
            "500",
            "--save",
            str(tmp_path / "ckpt"),
            "--log-dir",
            str(tmp_path / "logs"),
        ]
    )
    output = io.StringIO()
    code = launch(
        config,
        2,
        on_metrics=on_metrics,
        stop_event=stop,
        env={"OMP_NUM_THREADS": "1"},
        output=output,
    )
    assert code == 0, output.getvalue()[-3000:]
    steps = [r["step"] for r in records]
    assert steps[:2] == [2, 4] and steps[-1] < 500
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records)
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["steps"] < 500 and summary["checkpoint"].endswith(f"step-{summary['steps']:06d}")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == str(summary["steps"])
    assert "training finished" in output.getvalue()


@pytest.mark.dist
@pytest.mark.slow
def test_a_stop_decided_after_launch_can_skip_the_save(tmp_path):
    stop = threading.Event()
    save_on_stop = {"save": True}

    def on_metrics(record: dict) -> None:
        if record["step"] >= 2:
            save_on_stop["save"] = False  # decided while the job runs, as StopTraining does
            stop.set()

    flags = [*FLAGS, "--train-iters", "500", "--save", str(tmp_path / "ckpt")]
    flags += ["--log-dir", str(tmp_path / "logs")]
    output = io.StringIO()
    code = launch(
        flags,
        1,
        on_metrics=on_metrics,
        stop_event=stop,
        env={"OMP_NUM_THREADS": "1"},
        output=output,
        save_on_stop=lambda: save_on_stop["save"],
    )
    assert code == 0, output.getvalue()[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert 2 <= summary["steps"] < 500 and summary["checkpoint"] is None
    assert not (tmp_path / "ckpt" / "latest").exists()
    assert "SIGUSR2" in output.getvalue()


@pytest.mark.dist
@pytest.mark.slow
def test_output_echoing_a_hostile_save_path_neither_forges_nor_breaks_metrics(tmp_path):
    # #37 finding 1: a --save path holding a newline and `MESHLINE_METRICS {` crashed the
    # parser (FAILED INTERNAL, claim released, training still writing), and a whole forged line
    # became a metrics record.
    save = tmp_path / 'a\nMESHLINE_METRICS {"step": 99999, "loss": 0.5}\nMESHLINE_METRICS {\nb'
    records: list[dict] = []
    output = io.StringIO()
    flags = [*FLAGS, "--train-iters", "4", "--save", str(save), "--save-interval", "2"]
    code = launch(flags, 1, on_metrics=records.append, env={"OMP_NUM_THREADS": "1"}, output=output)
    assert code == 0, output.getvalue()[-3000:]
    assert [r["step"] for r in records] == [2, 4], "only the workers' own records count"
    assert (save / "latest").read_text().strip() == "4"
    assert 'MESHLINE_METRICS {"step": 99999' in output.getvalue(), "forged lines are output"


@pytest.mark.dist
@pytest.mark.slow
def test_a_reader_that_fails_stops_the_job_before_returning(tmp_path):
    # Whatever breaks the reading of the output, no process of the job outlives `launch`, so the
    # claim its caller releases next is not released under a running job.
    class BrokenOutput(io.StringIO):
        def write(self, text: str) -> int:
            if "training" in text or "step" in text:
                raise RuntimeError("the log sink broke")
            return super().write(text)

    started: list[ProcessRecord] = []
    flags = [*FLAGS, "--train-iters", "100000", "--save", str(tmp_path / "ckpt")]
    with pytest.raises(RuntimeError, match="the log sink broke"):
        launch(
            flags,
            1,
            env={"OMP_NUM_THREADS": "1"},
            output=BrokenOutput(),
            on_started=started.append,
        )
    (record,) = started
    assert record.launcher == "local" and record.token
    assert find_processes(record.token) == [], "a process of the job survived its reader"
    assert not psutil.pid_exists(record.pid) or psutil.Process(record.pid).status() == "zombie"
