"""Writes and deletes cannot be redirected out of the data root by a folder swapped for a symlink.

Finding 4 of issue 37: the `--log-dir` metrics CSV and the profile trace followed a log folder
swapped for a symlink, and preprocess clean-up deleted a folder outside the root after the
output folder was swapped. Each test swaps the folder (before the write, or between opening and
writing) and checks from the outside: no file appears there and nothing there is deleted.
Every library-level test runs twice: with `openat2` (when the kernel has it) and with the
component-by-component `O_NOFOLLOW` walk.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpoints import safe_fs
from kernels import device
from services.common.errors import PermissionDenied
from services.preprocess import staging
from services.trainer.arguments import parse_args
from training.metrics import MetricsWriter, StepMetrics
from training.profiling import StepProfiler

BASE = ["--model", "tiny-llama", "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
        "--eval-interval", "0", "--log-interval", "1"]  # fmt: skip


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    if request.param == "openat2" and not safe_fs.has_openat2():
        pytest.skip("this kernel has no openat2")
    if request.param == "walk":
        monkeypatch.setattr(safe_fs, "_openat2", None)
    return request.param


@pytest.fixture
def root(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    monkeypatch.setenv(safe_fs.ROOTS_ENV, str(path))
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "sentinel").write_text("not yours")
    return path


def _swap(folder: Path, target: Path) -> Path:
    """Moves `folder` aside and puts a symlink to `target` in its place; returns the moved one."""
    moved = folder.with_name(folder.name + ".moved")
    folder.rename(moved)
    folder.symlink_to(target, target_is_directory=True)
    return moved


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["sentinel"]
    assert (outside / "sentinel").read_text() == "not yours"


def test_every_operation_refuses_a_symlink_below_the_anchor(resolver, root, outside) -> None:
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "real").mkdir()
    with safe_fs.Dir.open_anchor(root) as anchor:
        for operation in (
            lambda: anchor.write_text("link/x", "x"),
            lambda: anchor.fdopen("link/metrics.csv", "a"),
            lambda: anchor.mkdir("link/sub"),
            lambda: anchor.subdir("link"),
            lambda: anchor.rmtree("link"),
            lambda: anchor.rename("real", "link/real"),
        ):
            with pytest.raises(safe_fs.Escape):
                operation()
        for escaping in ("../outside/x", "/etc/passwd"):
            with pytest.raises(safe_fs.Escape):
                anchor.write_text(escaping, "x")
    _untouched(outside)
    assert (root / "link").is_symlink() and (root / "real").is_dir()


def test_rmtree_unlinks_links_inside_the_tree_and_never_follows_them(resolver, root, outside):
    tree = root / "stage" / "deep"
    tree.mkdir(parents=True)
    (tree / "file").write_bytes(b"x" * 10)
    (tree / "to-outside").symlink_to(outside, target_is_directory=True)
    (root / "stage" / "file-link").symlink_to(outside / "sentinel")
    with safe_fs.Dir.open_anchor(root) as anchor:
        anchor.rmtree("stage")
    assert not (root / "stage").exists()
    _untouched(outside)


def test_an_opened_directory_stays_itself_after_its_path_is_swapped(resolver, root, outside):
    with safe_fs.open_dir_beneath(root / "a" / "b", create=True) as opened:
        moved = _swap(root / "a", outside)
        opened.write_text("result.json", "{}")
        with opened.fdopen("log.txt", "a") as handle:
            handle.write("line\n")
    assert (moved / "b" / "result.json").read_text() == "{}"
    assert (moved / "b" / "log.txt").read_text() == "line\n"
    _untouched(outside)
    with pytest.raises(safe_fs.Escape):  # opening it again now meets the link
        safe_fs.open_dir_beneath(root / "a" / "b", create=True)


def _row(step: int) -> StepMetrics:
    return StepMetrics(step, 2.5, 1.0, 1e-3, 10.0, 0.1, 0.01, 0.5, 0, 0, 1.0, 4, 1.0)


def test_metrics_csv_follows_no_log_dir_swapped_during_the_run(resolver, root, outside) -> None:
    logs = root / "run" / "logs"
    writer = MetricsWriter(logs, tensorboard=True)
    writer.write(_row(1))
    moved = _swap(root / "run", outside)
    writer.write(_row(2))
    writer.write_eval(2, 2.0)
    writer.close()
    _untouched(outside)
    rows = (moved / "logs" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[2].startswith("2,")
    assert len((moved / "logs" / "eval.csv").read_text().splitlines()) == 2
    assert list((moved / "logs" / "tensorboard").iterdir())  # the event file, in the real dir


def test_metrics_csv_refuses_a_log_dir_swapped_before_the_run(resolver, root, outside) -> None:
    (root / "logs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionError, match="symbolic link"):
        MetricsWriter(root / "logs" / "run1", tensorboard=False)
    _untouched(outside)


def test_profile_trace_follows_no_folder_swapped_inside_the_window(resolver, root, outside):
    prof = root / "prof"
    run = parse_args([*BASE, "--profile", "--profile-step-start", "0", "--profile-step-end", "1",
                      "--profile-save-path", str(prof)]).run  # fmt: skip
    profiler = StepProfiler(run, 0, device.resolve("cpu"))
    profiler.before_step(0)
    moved = _swap(prof, outside)
    profiler.after_step(1)
    _untouched(outside)
    assert [p.name for p in moved.iterdir()] == ["rank0.steps1-1.pt.trace.json"]
    assert (moved / "rank0.steps1-1.pt.trace.json").stat().st_size > 0


def test_profile_trace_refuses_a_folder_swapped_before_the_window(resolver, root, outside):
    (root / "prof").symlink_to(outside, target_is_directory=True)
    run = parse_args([*BASE, "--profile", "--profile-step-start", "0", "--profile-step-end", "1",
                      "--profile-save-path", str(root / "prof")]).run  # fmt: skip
    with pytest.raises(PermissionError, match="symbolic link"):
        StepProfiler(run, 0, device.resolve("cpu")).before_step(0)
    _untouched(outside)


def test_preprocess_cleanup_deletes_nothing_outside_after_the_output_is_swapped(
    resolver, root, outside
) -> None:
    out = root / "out"
    stage = staging.create(out, "corpus", (root,))
    (stage.path / "corpus_text_document.bin").write_bytes(b"\0" * 64)
    # The attacker's copy: a folder with the staging name, outside, that clean-up must not touch.
    (outside / stage.name).mkdir()
    (outside / stage.name / "precious").write_text("keep")
    moved = _swap(out, outside)
    stage.publish("corpus_text_document.bin")
    staging.release(stage)
    assert (outside / stage.name / "precious").read_text() == "keep"
    assert not (outside / "corpus_text_document.bin").exists()
    assert (moved / "corpus_text_document.bin").stat().st_size == 64
    assert not (moved / stage.name).exists()  # the real staging folder is gone


def test_preprocess_staging_refuses_an_output_swapped_before_the_job(resolver, root, outside):
    (root / "out").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied, match="output_prefix"):
        staging.create(root / "out" / "sub", "corpus", (root,))
    _untouched(outside)


def test_stale_staging_sweep_skips_links_with_staging_names(resolver, root, outside) -> None:
    (outside / ".corpus.partial-abcd1234").mkdir()
    (root / ".corpus.partial-abcd1234").symlink_to(
        outside / ".corpus.partial-abcd1234", target_is_directory=True
    )
    assert staging.sweep((root,)) == []
    assert (outside / ".corpus.partial-abcd1234").is_dir()
    assert os.path.islink(root / ".corpus.partial-abcd1234")


def test_evaluation_results_refuse_an_output_folder_swapped_for_a_symlink(resolver, root, outside):
    from services.evaluator.results import write_results

    (root / "eval").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied, match="output_path"):
        write_results(root / "eval" / "run1", [], {}, 0.0, (root,))
    _untouched(outside)
    path, _ = write_results(root / "real" / "run1", [], {}, 0.0, (root,))
    assert path.is_file() and path.parent == root / "real" / "run1"


def test_evaluator_response_cache_follows_no_folder_swapped_during_the_run(
    resolver, root, outside
) -> None:
    from services.evaluator.cache import ResponseCache

    cache = ResponseCache(root / "eval" / "cache", "model-a", "arc_easy")
    cache.add([("k1", "first")])
    moved = _swap(root / "eval", outside)
    cache.add([("k2", "second")])
    cache.close()
    _untouched(outside)
    (written,) = (moved / "cache").rglob("arc_easy.jsonl")
    assert len(written.read_text().splitlines()) == 2
