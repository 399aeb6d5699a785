"""The autotuner's search space, measurement and pick (`training.autotune`).

The trial jobs here are replaced by a runner that writes the metrics.csv a job would write
(MetricsWriter's own format) with chosen throughputs and peaks, so that every branch of the
selection is exercised in milliseconds; tests/services/trainer/test_autotune_cli.py runs real
trial jobs through `meshline train --autotune`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.trainer.arguments import parse_args
from training import autotune
from training.metrics import MetricsWriter, StepMetrics

BASE = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--train-iters", "50",
        "--autotune", "--autotune-warmup-steps", "2", "--autotune-steps", "3"]  # fmt: skip


def _write_metrics(directory: Path, steps: int, tokens_per_s: float, peak_gib: float) -> None:
    writer = MetricsWriter(directory, tensorboard=False)
    for step in range(1, steps + 1):
        # The warm-up steps are slow (as compiles and first touches are): they must not count.
        tps = tokens_per_s / 10 if step <= 2 else tokens_per_s
        writer.write(
            StepMetrics(step, 5.0, 1.0, 1e-4, tps, 0.0, 0.0, peak_gib, 0, 0, 1.0, 1, 64 / tps)
        )
    writer.close()


class FakeJobs:
    """Answers each trial with a throughput and peak from `table` (by micro-batch, stage)."""

    def __init__(self, table: dict[tuple[int, int], tuple[float, float] | str]):
        self.table = table
        self.seen: list[tuple[int, int, int, int]] = []

    def __call__(self, config, directory: Path, timeout: float) -> autotune.TrialRun:
        key = (config.batch.micro_batch_size, config.parallel.zero_stage)
        run = config.run
        self.seen.append((*key, run.train_iters, run.log_interval))
        assert run.save is None and run.load is None and run.eval_interval == 0
        assert not config.autotune.autotune
        answer = self.table.get(key, "crash")
        if answer == "crash":
            return autotune.TrialRun(137)
        if answer == "timeout":
            return autotune.TrialRun(0, timed_out=True)
        tps, peak = answer
        _write_metrics(directory, run.train_iters, tps, peak)
        return autotune.TrialRun(0)


def test_micro_batch_sizes_follow_the_bounds_and_the_global_batch():
    config = parse_args([*BASE, "--autotune-max-micro-batch-size", "16"])
    assert autotune.micro_batch_sizes(config, 1) == [1, 4, 16]  # 3 spread over 1..16
    config = parse_args(
        [*BASE, "--global-batch-size", "12", "--autotune-num-micro-batch-sizes", "9"]
    )
    assert autotune.micro_batch_sizes(config, 2) == [1, 2]  # 12 / 2 ranks: 4 does not divide 6
    config = parse_args([*BASE, "--autotune-min-micro-batch-size", "3"])
    assert autotune.micro_batch_sizes(config, 1) == [3, 6]


def test_plan_tries_every_stage_with_several_ranks_and_keeps_one_alone():
    config = parse_args([*BASE, "--autotune-num-micro-batch-sizes", "2"])
    alone = autotune.plan(config, 1)
    assert [(t.micro_batch_size, t.zero_stage) for t in alone] == [(1, 0), (8, 0)]
    both = autotune.plan(config, 2)
    assert [t.zero_stage for t in both] == [0, 0, 1, 1, 2, 2, 3, 3]
    config = parse_args(
        [*BASE, "--autotune-zero-stages", "3", "--autotune-recompute", "none", "full"]
    )
    assert {(t.zero_stage, t.recompute) for t in autotune.plan(config, 2)} == {
        (3, "none"),
        (3, "full"),
    }


def test_the_pick_is_the_argmax_of_the_measured_trials(tmp_path):
    config = parse_args(
        [*BASE, "--autotune-zero-stages", "0", "1", "--autotune-memory-limit", "1GiB"]
    )
    jobs = FakeJobs(
        {
            (1, 0): (1000.0, 0.5),
            (4, 0): (3000.0, 0.6),
            (8, 0): (9000.0, 1.5),  # the fastest, but over the memory limit
            (1, 1): (1500.0, 0.5),
            (4, 1): "crash",
            (8, 1): (99999.0, 0.1),  # never run: a smaller micro-batch of stage 1 failed
        }
    )
    lines: list[str] = []
    result = autotune.tune(config, 2, jobs, tmp_path, lines.append)
    statuses = [(t.trial.micro_batch_size, t.trial.zero_stage, t.status) for t in result.trials]
    assert statuses == [
        (1, 0, "ok"),
        (4, 0, "ok"),
        (8, 0, "over memory"),
        (1, 1, "ok"),
        (4, 1, "failed"),
        (8, 1, "skipped"),
    ]
    # Each trial ran warm-up + measured steps with a metrics row per step.
    assert all(seen[2:] == (5, 1) for seen in jobs.seen) and len(jobs.seen) == 5
    accepted = [t for t in result.trials if t.status == "ok"]
    assert result.best is max(accepted, key=lambda t: t.tokens_per_s)
    assert (result.best.trial.micro_batch_size, result.best.trial.zero_stage) == (4, 0)
    # Measured over the steps after the warm-up only (the warm-up ran at a tenth).
    assert result.best.tokens_per_s == pytest.approx(3000.0)
    table = autotune.format_table(result, config)
    assert "<- best" in table and "over memory: peak 1536.0 MiB" in table
    autotune.write_report(result, tmp_path / "autotune.json")
    report = json.loads((tmp_path / "autotune.json").read_text())
    assert report["best"] == {"micro_batch_size": 4, "zero_stage": 0, "recompute": "none"}
    assert [t["status"] for t in report["trials"]][:3] == ["ok", "ok", "over memory"]
    chosen = autotune.apply(config, result.best.trial)
    assert chosen.batch.micro_batch_size == 4 and chosen.parallel.zero_stage == 0
    assert not chosen.autotune.autotune and chosen.run.train_iters == 50


def test_early_stopping_max_trials_and_timeouts(tmp_path):
    config = parse_args(
        [*BASE, "--autotune-zero-stages", "0", "1", "2", "--autotune-early-stopping", "2"]
    )
    table = {(m, s): (1000.0 - 10 * s - m, 0.1) for m in (1, 4, 8) for s in (0, 1, 2)}
    table[(1, 0)] = "timeout"
    result = autotune.tune(config, 2, FakeJobs(table), tmp_path / "a", lambda _: None)
    statuses = [t.status for t in result.trials]
    # Stage 0 times out at micro-batch 1 (its larger ones skipped), stage 1's first is the
    # best, two trials in a row do not beat it: the rest is not run.
    assert statuses == ["timed out", "skipped", "skipped", "ok", "ok", "ok", *["not run"] * 3]
    assert result.best is result.trials[3]
    config = parse_args([*BASE, "--autotune-zero-stages", "0", "1", "--autotune-max-trials", "2"])
    result = autotune.tune(config, 2, FakeJobs(table | {(1, 0): (1.0, 0.1)}), tmp_path / "b")
    assert [t.status for t in result.trials] == ["ok", "ok", *["not run"] * 4]


def test_nothing_accepted_and_invalid_points(tmp_path):
    config = parse_args(
        [*BASE, "--autotune-zero-stages", "1", "--autotune-num-micro-batch-sizes", "1"]
    )
    result = autotune.tune(config, 1, FakeJobs({}), tmp_path, lambda _: None)
    # A crash of the only point leaves no pick.
    assert [t.status for t in result.trials] == ["failed"] and result.best is None
    assert "no trial was accepted" in autotune.format_table(result, config)
    config = parse_args([*BASE, "--cpu-offload", "--zero-stage", "3"])
    result = autotune.tune(
        config, 2, FakeJobs({(m, 3): (5.0, 0.1) for m in (1, 2, 4, 8)}), tmp_path / "x"
    )
    # --cpu-offload needs ZeRO-3: the other stages are invalid points, never launched.
    assert {t.trial.zero_stage for t in result.trials if t.status == "invalid"} == {0, 1, 2}
    assert result.best is not None and result.best.trial.zero_stage == 3


def test_settings_are_checked_by_flag_name():
    with pytest.raises(ValueError, match="--autotune-steps set"):
        parse_args(["--autotune-steps", "3"])
    with pytest.raises(ValueError, match="--autotune-zero-stages"):
        parse_args(["--autotune", "--autotune-zero-stages", "5"])
    with pytest.raises(ValueError, match="--autotune-memory-limit"):
        parse_args(["--autotune", "--autotune-memory-limit", "lots"])
    with pytest.raises(ValueError, match="--autotune-recompute"):
        parse_args(["--autotune", "--autotune-recompute", "some"])
    with pytest.raises(ValueError, match="--rampup-batch-size"):
        parse_args(
            [*BASE, "--global-batch-size", "8", "--rampup-batch-size", "4", "4", "8"]
        ).validate(1)


def test_a_second_tuning_in_the_same_folder_measures_afresh(tmp_path):
    config = parse_args([*BASE, "--autotune-num-micro-batch-sizes", "1"])
    first = autotune.tune(config, 1, FakeJobs({(8, 0): (100.0, 0.1)}), tmp_path, print)
    second = autotune.tune(config, 1, FakeJobs({(8, 0): (700.0, 0.1)}), tmp_path, print)
    assert first.best.tokens_per_s == pytest.approx(100.0)
    assert second.best.tokens_per_s == pytest.approx(700.0)
