"""`--load` of a checkpoint saved by another run with another model is refused before any
worker starts, naming the flag (#37: a checkpoint resumed into a different run)."""

from __future__ import annotations

import pytest

from services.trainer.arguments import parse_args
from training.launch_checks import load_action
from training.loop import Trainer

BASE = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "2", "--eval-interval", "0",
        "--log-interval", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("run-a") / "ckpt"
    Trainer(parse_args(["--model", "tiny-llama", *BASE, "--train-iters", "1", "--save", str(directory)])).fit()  # fmt: skip
    return directory


def test_the_same_model_resumes(saved):
    assert (
        load_action(parse_args(["--model", "tiny-llama", *BASE, "--load", str(saved)])) == "resume"
    )


def test_another_runs_model_is_refused_naming_the_flag(saved):
    config = parse_args(["--model", "tiny-llama-gqa", *BASE, "--load", str(saved)])
    with pytest.raises(
        ValueError, match=r"num_kv_heads .* \(--num-query-groups\); it was saved by another run"
    ):
        load_action(config)
    # --finetune reads the weights only, into the model it names: not a resume, not checked here.
    finetune = parse_args(["--model", "tiny-llama-gqa", *BASE, "--load", str(saved), "--finetune"])
    assert load_action(finetune) == "resume"
