"""`meshline train --autotune`: real trial jobs, the measured fastest picked, the run uses it.

Each trial is a torchrun launch of the trainer's own workers; the test re-reads every trial's
metrics.csv, recomputes its throughput over the measured steps and checks that the pick is the
argmax, and that the run that follows was launched from the chosen config and trained with its
micro-batch (its metrics.csv records the global batch of every step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from services.trainer.arguments import parse_args
from services.trainer.cli import main as train_main
from training.autotune import measure
from training.metrics import read_csv

FLAGS = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--train-iters", "3",
         "--eval-interval", "0", "--log-interval", "1"]  # fmt: skip


@pytest.mark.slow
def test_autotune_picks_the_measured_fastest_and_trains_with_it(tmp_path):
    log_dir = tmp_path / "run"
    argv = [*FLAGS, "--log-dir", str(log_dir), "--autotune", "--autotune-warmup-steps", "1",
            "--autotune-steps", "2", "--autotune-max-micro-batch-size", "4",
            "--autotune-num-micro-batch-sizes", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHLINE_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "services.trainer.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tokens/s/dev" in done.stdout and "<- best" in done.stdout
    tuning = log_dir / "autotune"
    report = json.loads((tuning / "autotune.json").read_text())
    trials = report["trials"]
    assert [(t["micro_batch_size"], t["status"]) for t in trials] == [(1, "ok"), (4, "ok")]
    measured = []
    for index, trial in enumerate(trials, start=1):
        tokens_per_s, peak = measure(tuning / f"trial-{index:02d}" / "metrics.csv", 1, 2)
        assert trial["tokens_per_s"] == pytest.approx(tokens_per_s)
        assert trial["peak_bytes"] == peak
        measured.append((tokens_per_s, trial["micro_batch_size"]))
    fastest = max(measured)[1]
    assert report["best"]["micro_batch_size"] == fastest
    # The run that follows reads the chosen config and trains with that micro-batch.
    chosen = yaml.safe_load((tuning / "chosen" / "train_config.yaml").read_text())
    assert chosen["batch"]["micro_batch_size"] == fastest
    assert chosen["autotune"]["autotune"] is False and chosen["run"]["train_iters"] == 3
    assert f"training with --micro-batch-size {fastest} " in done.stdout
    run = read_csv(log_dir / "metrics.csv")
    assert run["step"] == [1.0, 2.0, 3.0] and set(run["global_batch"]) == {float(fastest)}


@pytest.mark.slow
def test_trials_over_the_memory_limit_or_the_timeout_are_rejected(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHLINE_DEVICE": "cpu"}
    one = ["--autotune", "--autotune-num-micro-batch-sizes", "1", "--autotune-warmup-steps", "1",
           "--autotune-steps", "1"]  # fmt: skip
    for extra, status in (
        (["--autotune-memory-limit", "1MiB"], "over memory"),
        (["--autotune-trial-timeout", "0.5"], "timed out"),
    ):
        tuning = tmp_path / status.replace(" ", "_")
        command = [sys.executable, "-m", "services.trainer.cli", *FLAGS, *one, *extra]
        done = subprocess.run(
            [*command, "--autotune-dir", str(tuning)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert "no trial was accepted" in done.stderr and f"  {status}: " in done.stdout
        report = json.loads((tuning / "autotune.json").read_text())
        assert [t["status"] for t in report["trials"]] == [status] and report["best"] is None
        assert not (tuning / "chosen").exists()


def test_dry_run_lists_the_points_and_bad_layouts_are_refused_before_any_trial(capsys):
    argv = [*FLAGS, "--autotune", "--autotune-zero-stages", "0", "3", "--dry-run",
            "--world-size", "2", "--autotune-num-micro-batch-sizes", "2"]  # fmt: skip
    code = train_main(argv)
    out = capsys.readouterr().out
    assert code == 0 and "--autotune would try 4 points" in out
    assert "--micro-batch-size 8 --zero-stage 3" in out
    code = train_main([*FLAGS, "--autotune", "--nnodes", "2", "--nproc-per-node", "1"])
    assert code == 2 and "--nnodes 1" in capsys.readouterr().err
    assert parse_args([*FLAGS, "--autotune"]).autotune.autotune


def test_the_trainer_service_refuses_autotune_by_name(tmp_path):
    from services.common.errors import InvalidArgument
    from services.trainer.servicer import parse_training_flags

    with pytest.raises(InvalidArgument, match="--autotune"):
        parse_training_flags([*FLAGS, "--autotune"], 1, (tmp_path,))
