"""`meshline train` in-process and `meshline plot` through the console entry; every --optimizer runs."""

from __future__ import annotations

import math

import pytest

from services import cli as meshline
from services.trainer.arguments import parse_args
from training.loop import Trainer

SMOKE = ["--model", "tiny-llama", "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
         "--eval-interval", "0"]  # fmt: skip


def test_meshline_train_then_plot(tmp_path, capsys):
    logs = tmp_path / "logs"
    code = meshline.main(
        ["train", *SMOKE, "--train-iters", "3", "--log-interval", "1", "--log-dir", str(logs)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step 3/3 | loss" in out and "training finished" in out
    assert (logs / "summary.json").is_file()
    assert meshline.main(["plot", str(logs)]) == 0
    assert sorted(p.name for p in (logs / "plots").iterdir()) == [
        "loss.png",
        "lr.png",
        "throughput.png",
    ]


def test_meshline_train_reports_bad_flags(tmp_path, capsys):
    assert meshline.main(["train", "--model", "tiny-llama"]) == 2
    assert "--data-path" in capsys.readouterr().err
    assert meshline.main(["train", *SMOKE, "--load", str(tmp_path / "none")]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert meshline.main(["plot", str(tmp_path)]) == 2
    assert "metrics.csv" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["adam", "adamw", "fused_adam", "cadam", "sgd"])
def test_every_optimizer_trains(name):
    trainer = Trainer(
        parse_args([*SMOKE, "--train-iters", "2", "--optimizer", name, "--lr", "1e-3"])
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    results = [trainer.train_step() for _ in range(2)]
    assert all(math.isfinite(r.loss) and not r.skipped for r in results)
    assert any(not p.equal(before[n]) for n, p in trainer.model.named_parameters())
