"""Pipeline specifics: validation through the stages equals the 1-process validation loss, and a
step with fewer micro-batches than stages is refused with the flags to change."""

from __future__ import annotations

import pytest

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.parallel.parity import BASE
from training.loop import Trainer

EVAL = ["--eval-iters", "3", "--train-iters", "2"]
LAYOUTS = {
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2-v2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2-zbv": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                "--pipeline-schedule", "zbv"],
}  # fmt: skip


def _val_losses(rank: int, world_size: int, flags: list[str]) -> list[float]:
    trainer = Trainer(parse_args([*BASE, *EVAL, *flags]))
    before = trainer.evaluate()
    trainer.train_step()
    return [before, trainer.evaluate()]


def _all(rank: int, world_size: int) -> dict[str, list[float]]:
    return {name: _val_losses(rank, world_size, flags) for name, flags in LAYOUTS.items()}


def _too_few_micro_batches(rank: int, world_size: int) -> str:
    flags = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"]
    trainer = Trainer(parse_args([*BASE, *flags]))  # later flags override BASE's
    try:
        trainer.train_step()
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_pipeline_validation_matches_single_process():
    reference = run_distributed(_val_losses, 1, [])[0]
    for by_layout in run_distributed(_all, 2):
        for name, losses in by_layout.items():
            assert losses == pytest.approx(reference, rel=1e-6), name


@pytest.mark.dist
def test_too_few_micro_batches_name_the_flags():
    for message in run_distributed(_too_few_micro_batches, 2):
        assert "--pipeline-model-parallel-size is 2" in message
        assert "--global-batch-size" in message
