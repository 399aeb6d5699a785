"""`make eval` without a `make train` checkpoint stops early, saying what to run."""

from __future__ import annotations

from services.demos.evaluate import main


def test_missing_checkpoint_names_make_train(tmp_path, capsys):
    assert main(["--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "run `make train` first" in err
