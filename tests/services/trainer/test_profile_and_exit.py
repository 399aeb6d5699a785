"""--profile (a trace of a window of steps) and --exit-interval / --exit-duration-in-mins (stop
early, saving), as Megatron-LM and MindSpeed scripts use them."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from kernels import device
from services import cli as meshline
from services.trainer.arguments import parse_args
from services.trainer.request_paths import confine_config
from tests.harness import run_distributed
from training.loop import Trainer
from training.profiling import StepProfiler

BASE = ["--model", "tiny-llama", "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
        "--eval-interval", "0", "--log-interval", "1"]  # fmt: skip


def _trainer(*flags: str) -> Trainer:
    return Trainer(parse_args([*BASE, *flags]))


def _trace(path: Path) -> tuple[list[str], set[str]]:
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    return sorted(n for n in names if n.startswith("ProfilerStep#")), names


def test_profile_records_the_window_and_names_the_top_ops(tmp_path, caplog):
    prof = tmp_path / "prof"
    trainer = _trainer(
        *("--train-iters", "6", "--profile", "--profile-step-start", "2"),
        *("--profile-step-end", "4", "--profile-save-path", str(prof)),
    )
    with caplog.at_level(logging.INFO, logger="training.profiling"):
        summary = trainer.fit()
    assert summary.steps == 6 and summary.stopped_by is None
    # Steps 2 and 3 (0-based, Megatron's count) are the log's steps 3 and 4.
    assert [p.name for p in prof.iterdir()] == ["rank0.steps3-4.pt.trace.json"]
    steps, names = _trace(prof / "rank0.steps3-4.pt.trace.json")
    assert steps == ["ProfilerStep#3", "ProfilerStep#4"]
    assert "aten::mm" in names
    line = next(r.getMessage() for r in caplog.records if "profile of rank 0" in r.getMessage())
    assert "the log's steps 3-4" in line and "most time: " in line and "%" in line


def test_profile_window_cut_short_by_the_end_of_the_run(tmp_path):
    """A window from step 0 (no warm-up step) past --train-iters: the steps run are written."""
    trainer = _trainer(
        *("--train-iters", "2", "--profile", "--profile-step-start", "0"),
        *("--profile-step-end", "5", "--log-dir", str(tmp_path / "logs")),
    )
    trainer.fit()
    trace = tmp_path / "logs" / "profile" / "rank0.steps1-2.pt.trace.json"
    assert _trace(trace)[0] == ["ProfilerStep#1", "ProfilerStep#2"]


def test_profile_ranks_and_a_resumed_run_past_the_window(tmp_path, caplog):
    run = parse_args([*BASE, "--profile", "--profile-step-start", "1", "--profile-step-end",
                      "2"]).run  # fmt: skip
    run.profile_ranks = [1]
    cpu = device.resolve("cpu")
    assert not StepProfiler(run, 0, cpu).enabled and StepProfiler(run, 1, cpu).enabled
    run.profile_ranks = [-1]
    profiler = StepProfiler(run, 5, cpu)
    with caplog.at_level(logging.WARNING, logger="training.profiling"):
        profiler.check_start(7)
    assert "the run starts at step 7, at or after --profile-step-end 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training.profiling"):
        profiler.check_start(1)  # inside the window: it will be profiled, no warning
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--profile-step-start", "4", "--profile-step-end", "4"], "need 0 <= start < end"),
        (["--profile-ranks", "-2"], "-1 for every rank"),
        (["--exit-interval", "-1"], "must be >= 0"),
        (["--exit-duration-in-mins", "-5"], "must be >= 0"),
    ],
)
def test_bad_profile_and_exit_flags_name_the_fix(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args([*BASE, *flags])


def test_profile_window_and_ranks_checked_against_the_job():
    config = parse_args([*BASE, "--train-iters", "5", "--profile", "--profile-ranks", "0", "2"])
    with pytest.raises(ValueError, match=r"--profile-ranks 2: the job has ranks 0-1"):
        config.validate(2)
    config = parse_args([*BASE, "--train-iters", "8", "--profile"])  # default start 10
    with pytest.raises(ValueError, match="--profile-step-start 10 is not before --train-iters 8"):
        config.validate(1)


def test_profile_default_dir_follows_the_log_dir_and_is_confined(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    config = parse_args([*BASE, "--profile", "--profile-step-start", "0", "--profile-step-end",
                         "1", "--log-dir", str(root / "logs")])  # fmt: skip
    confined = confine_config(config, [root])
    assert confined.run.profile_save_path == str(root / "logs" / "profile")
    assert config.run.profile_dir() == str(root / "logs" / "profile")
    config.run.log_dir = None
    assert config.run.profile_dir() == "profile_dir"


def test_exit_interval_saves_and_the_run_resumes(tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--save", str(save), "--save-interval", "2"]
    first = _trainer(*flags, "--exit-interval", "4").fit()
    assert first.steps == 4 and first.stopped_by == "--exit-interval 4"
    # Step 4 was saved by --save-interval already: the exit keeps that save, writes no other.
    assert first.checkpoint == str(save / "step-000004")
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["step-000002", "step-000004"]
    resumed = _trainer(*flags, "--load", str(save))
    assert resumed.load() == 4
    second = resumed.fit()
    assert second.steps == 6 and second.stopped_by is None
    assert second.checkpoint == str(save / "step-000006")


def test_exit_interval_without_save_interval_saves_at_the_exit(tmp_path):
    save = tmp_path / "ckpt"
    summary = _trainer("--train-iters", "5", "--save", str(save), "--exit-interval", "3").fit()
    assert summary.steps == 3 and summary.checkpoint == str(save / "step-000003")


def test_exit_duration_stops_at_the_next_step_boundary():
    trainer = _trainer("--train-iters", "50", "--exit-duration-in-mins", "1")
    trainer._started = time.monotonic() - 61  # a minute of set-up already spent
    summary = trainer.fit()
    assert summary.steps == 1 and summary.stopped_by == "--exit-duration-in-mins 1"


def _exit_when_one_rank_is_late(rank: int, world_size: int) -> int:
    trainer = _trainer("--train-iters", "20", "--exit-duration-in-mins", "1")
    if rank == 1:  # only this rank's clock is past the limit: every rank stops with it
        trainer._started = time.monotonic() - 61
    return trainer.fit().steps


def test_exit_duration_is_agreed_across_ranks():
    assert run_distributed(_exit_when_one_rank_is_late, 2) == [1, 1]


def test_meshline_train_profiles_and_exits_from_the_command_line(tmp_path, capsys):
    logs = tmp_path / "logs"
    flags = ["--train-iters", "6", "--exit-interval", "3", "--log-dir", str(logs),
             "--save", str(tmp_path / "ckpt"), "--profile", "--profile-step-start", "1",
             "--profile-step-end", "2"]  # fmt: skip
    code = meshline.main(["train", *BASE, *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "stopped early    by --exit-interval 3" in out
    assert "step-000003" in out
    assert (logs / "profile" / "rank0.steps2-2.pt.trace.json").is_file()
