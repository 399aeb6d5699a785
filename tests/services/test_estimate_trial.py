"""`meshline estimate --auto --trial N`: the analytic ranking's top N measured, the fastest fit.

The slow test runs real trial jobs (torchrun launches of the trainer's workers) on tiny-llama and
recomputes every trial's throughput from its metrics.csv; the fast ones check the pick over
layouts of different data-parallel sizes with MetricsWriter files written by a stand-in runner,
and that what cannot be measured here is refused by name before any worker starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from models.auto_config import Hardware, candidates
from models.registry import get_config
from services import estimate_trial
from services.cli import main as meshline
from training import autotune
from training.autotune_section import AutotuneSection
from training.metrics import MetricsWriter, StepMetrics

ESTIMATE = ["estimate", "--auto", "--model", "tiny-llama", "--world-size", "2",
            "--device-memory", "4GiB", "--global-batch-size", "8", "--seq-length", "32"]  # fmt: skip


@pytest.mark.slow
def test_the_top_ranked_layouts_are_measured_and_the_fastest_fit_is_picked(tmp_path):
    trials = tmp_path / "trials"
    argv = [*ESTIMATE, "--trial", "3", "--trial-warmup-steps", "1", "--trial-steps", "2",
            "--trial-dir", str(trials), "--mock-data", "--lr", "2e-4"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHLINE_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((trials / "trials.json").read_text())
    # The analytic ranking decided which layouts were tried, in its order.
    ranked = candidates(get_config("tiny-llama"), 2, 8, 32, Hardware(4 << 30, 2), precision="fp32")
    assert [t["layout"] for t in report["trials"]] == [asdict(c.layout) for c in ranked[:3]]
    assert [t["rank"] for t in report["trials"]] == [1, 2, 3]
    measured = {}
    for index, trial in enumerate(report["trials"], start=1):
        assert trial["status"] == "ok", trial
        got = autotune.measure(trials / f"trial-{index:02d}" / "metrics.csv", 1, 2)
        assert got is not None
        job = got[0] * 2  # tokens/s per device x the 2 devices
        assert trial["job_tokens_per_s"] == pytest.approx(job)
        assert trial["peak_bytes"] == got[1] <= 4 << 30
        measured[trial["rank"]] = job
    pick = max(measured, key=measured.__getitem__)
    assert report["pick"] == pick
    # The printed table lists every trial, the pick marked, and the command to run it.
    table = done.stdout.split("status\n", 1)[1].splitlines()
    rows = [line.split() for line in table[1:4]]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert [line.endswith("<- pick") for line in table[1:4]] == [r == pick for r in (1, 2, 3)]
    layout = report["trials"][pick - 1]["layout"]
    command = done.stdout.strip().splitlines()[-1]
    assert command.startswith("meshline train --nproc-per-node 2 --model tiny-llama ")
    assert f"--micro-batch-size {layout['micro_batch_size']} " in command
    assert f"--zero-stage {layout['zero_stage']} " in command
    assert command.endswith("--mock-data --lr 2e-4")


def _write_metrics(directory: Path, steps: int, tokens_per_s: float, peak_gib: float) -> None:
    writer = MetricsWriter(directory, tensorboard=False)
    for step in range(1, steps + 1):
        writer.write(
            StepMetrics(step, 5.0, 1.0, 1e-4, tokens_per_s, 0.0, 0.0, peak_gib, 0, 0, 1.0, 8, 0.1)
        )
    writer.close()


def test_the_pick_is_the_fastest_job_among_the_trials_that_fit(tmp_path):
    # tokens/s per device, peak GiB by (TP, DP): the job runs 2 devices' worth.
    answers = {(2, 1): (150.0, 1.0), (1, 2): (200.0, 1.0), (1, 1): (450.0, 9.0)}
    seen = []

    def run_trial(config, directory: Path, timeout: float) -> autotune.TrialRun:
        key = (config.parallel.tensor_model_parallel_size, config.dp_size(2))
        if config.parallel.pipeline_model_parallel_size == 2:
            key = (1, 1)
        seen.append(key)
        tps, peak = answers[key]
        _write_metrics(directory, config.run.train_iters, tps, peak)
        return autotune.TrialRun(0)

    parser = estimate_trial.build_parser()
    args, rest = parser.parse_known_args([*ESTIMATE[1:], "--trial", "3", "--mock-data"])
    config = estimate_trial.base_config(args, rest)
    section = AutotuneSection(
        autotune=True, autotune_warmup_steps=1, autotune_steps=2, autotune_memory_limit="4GiB"
    )
    ranked = candidates(config.model_config(), 2, 8, 32, Hardware(4 << 30, 2), precision="fp32")
    chosen = [
        next(c for c in ranked if c.layout.tensor_parallel == 2),
        next(c for c in ranked if c.layout.data_parallel == 2),
        next(c for c in ranked if c.layout.pipeline_parallel == 2),
    ]
    points = [
        (estimate_trial.layout_config(config, c, section), estimate_trial.trial_of(c))
        for c in chosen
    ]
    assert points[0][0].parallel.sequence_parallel  # the candidate's TP layout, SP included
    result = autotune.run_points(points, 2, run_trial, tmp_path, report=lambda _: None)
    assert seen == [(2, 1), (1, 2), (1, 1)]
    assert [t.status for t in result.trials] == ["ok", "ok", "over memory"]
    # 200 x 2 devices beats 150 x 2; the 450 of the PP layout does not fit 4 GiB.
    assert result.best is result.trials[1]


def test_what_this_machine_cannot_measure_is_refused_by_name(capsys):
    cases = [
        (["--trial", "2"], "add --auto"),
        (["--auto", "--trial", "0"], "--trial 0"),
        ([*ESTIMATE[1:], "--trial", "1", "--zero-stage", "1"], "--zero-stage: --auto --trial"),
        ([*ESTIMATE[1:], "--trial", "1", "--autotune-steps", "3"], "--autotune-steps is"),
        ([*ESTIMATE[1:], "--trial", "1", "--top", "9"], "--top: with --trial"),
        ([*ESTIMATE[1:], "--trial", "1", "--nproc-per-node", "1"], "--nproc-per-node 1 with"),
        (
            [
                *ESTIMATE[1:4],
                "--world-size",
                "4096",
                "--device-memory",
                "4GiB",
                "--seq-length",
                "32",
                "--trial",
                "1",
            ],
            "--world-size 4096: this machine launches at most",
        ),
        (
            [
                "--auto",
                "--model",
                "llama2-70B",
                "--world-size",
                "1",
                "--device-memory",
                "8TB",
                "--seq-length",
                "256",
                "--trial",
                "1",
            ],
            "--model llama2-70B: its ranked layouts need",
        ),
    ]
    for argv, message in cases:
        code = meshline(["estimate", *(a for a in argv if a != "estimate"), "--mock-data"])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (argv, err)
    assert "drop --trial" in err and "smaller --model" in err
    # Without --trial, `estimate --auto` stays the analytic ranking of models.estimate.
    assert meshline(ESTIMATE) == 0
    assert "best:" in capsys.readouterr().out


def test_a_cpu_trial_has_one_rank_a_core_and_shares_host_memory():
    parser = estimate_trial.build_parser()
    args, _ = parser.parse_known_args([*ESTIMATE[1:], "--trial", "1"])
    ranked = candidates(get_config("tiny-llama"), 2, 8, 32, Hardware(4 << 30, 2))[:1]
    cpu = estimate_trial.LocalMachine("cpu", 1, None)
    with pytest.raises(ValueError, match="at most 1 trial ranks"):
        estimate_trial.check_machine(args, ranked, cpu, "tiny-llama")
    tight = estimate_trial.LocalMachine("cpu", 2, int(ranked[0].peak_bytes * 1.5))
    with pytest.raises(ValueError, match="host memory available"):
        estimate_trial.check_machine(args, ranked, tight, "tiny-llama")
    gpu = estimate_trial.LocalMachine("cuda", 2, int(ranked[0].peak_bytes * 1.5))
    assert estimate_trial.check_machine(args, ranked, gpu, "tiny-llama") == 2
