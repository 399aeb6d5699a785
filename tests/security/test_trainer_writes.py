"""The trainer's own files cannot be redirected by a folder swapped for a symlink (issue 37):
`summary.json` in --log-dir (written by the worker after the run); the launcher's resolved
`train_config.yaml` is written whole through the same helper. Like tests/security/test_safe_fs.py, each swaps the folder and checks from
outside that nothing appears there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoints import safe_fs
from services.trainer.arguments import parse_args
from services.trainer.launcher import config_argv
from services.trainer.train import write_summary
from training.loop import RunSummary


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


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["sentinel"]


def _summary() -> RunSummary:
    return RunSummary(3, 5.0, 4.0, None, 1.0, 0, 0, None)


def test_summary_is_written_atomically_into_the_log_dir(root: Path) -> None:
    write_summary(_summary(), root / "logs")
    assert json.loads((root / "logs" / "summary.json").read_text())["steps"] == 3
    assert sorted(p.name for p in (root / "logs").iterdir()) == ["summary.json"]


def test_summary_refuses_a_log_dir_swapped_for_a_symlink(root: Path, outside: Path) -> None:
    (root / "logs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(safe_fs.Escape):
        write_summary(_summary(), root / "logs")
    _untouched(outside)


def test_summary_refuses_a_log_dir_outside_the_data_root(root: Path, outside: Path) -> None:
    with pytest.raises(safe_fs.Escape):
        write_summary(_summary(), outside / "logs")
    _untouched(outside)


def test_resolved_config_is_written_whole_into_the_folder_opened(tmp_path: Path) -> None:
    config = parse_args(["--model", "tiny-llama", "--mock-data", "--train-iters", "2"])
    flags = config_argv(config, tmp_path / "launch")
    written = Path(flags[1])
    assert written.parent == (tmp_path / "launch").resolve()
    assert sorted(p.name for p in written.parent.iterdir()) == ["train_config.yaml"]
    assert parse_args(flags, read_files=True).run.train_iters == 2


def test_checkpoint_publish_pointer_and_pruning_stay_beneath_the_root(
    root: Path, outside: Path
) -> None:
    """The checkpoint manager publishes a step, moves `latest` and prunes old steps through the
    save folder opened beneath the data root: once that folder is swapped for a symlink, a
    publish is refused and nothing appears (or disappears) outside."""
    from training.checkpoint import CheckpointManager, read_latest

    save = root / "ckpt"
    manager = CheckpointManager(save, keep_last=1)
    for step in (1, 2):  # an ordinary run: publish, pointer, prune
        tmp = save / f"step-{step:06d}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "train_state.json").write_text("{}")
        manager._finalize(step, tmp)
    assert read_latest(save) == 2 and sorted(p.name for p in save.iterdir()) == [
        "latest",
        "step-000002",
    ]
    (root / "real").mkdir()
    (save / "step-000003.tmp").mkdir()
    save.rename(root / "real" / "ckpt")
    save.symlink_to(outside, target_is_directory=True)  # the folder swapped for a link
    (outside / "step-000003.tmp").mkdir()
    with pytest.raises(safe_fs.Escape):
        manager._finalize(3, save / "step-000003.tmp")
    assert sorted(p.name for p in outside.iterdir()) == ["sentinel", "step-000003.tmp"]
