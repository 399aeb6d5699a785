"""Tied embeddings under pipeline parallelism (tiny-bloom ties its head to the embedding).

The first stage holds the embedding, the last stage a copy as its head; their gradients are
summed over the embedding group every step (or, when one rank holds both stages as in the V
schedules, the two chunks share the parameter). Loss curves and final parameters must match the
single-process tied model within the parity tolerances, every copy of the tied matrix must
equal the reference's, and a checkpoint keeps the one global name: one saved under PP2 resumes
on a single process (and the reverse) with the uninterrupted run's next loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.parallel.parity import (
    BASE,
    STEPS,
    max_loss_diff,
    max_param_diff,
    run_layout,
)
from tests.parallel.test_parity import LOSS_RTOL, PARAM_RTOL
from training.loop import Trainer

TIED = ["--model", "tiny-bloom"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "pp2-1f1b": PP2,
    "pp2-zbv": [*PP2, "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "zbv"],
}
CKPT_STEPS = 3


def _layouts(rank: int, world_size: int) -> dict[str, dict]:
    return {
        name: run_layout(rank, world_size, [*TIED, *flags], STEPS)
        for name, flags in LAYOUTS.items()
    }


@pytest.mark.dist
@pytest.mark.slow
def test_tied_embeddings_under_pipeline_match_single_process():
    single = run_distributed(run_layout, 1, TIED, STEPS)[0]
    for rank, by_layout in enumerate(run_distributed(_layouts, 2)):
        for name, got in by_layout.items():
            loss_diff = max_loss_diff(single["losses"], got["losses"])
            param_diff = max_param_diff(single["params"], got["params"])
            print(f"{name} rank {rank}: loss rel {loss_diff:.2e}, params rel {param_diff:.2e}")
            assert loss_diff < LOSS_RTOL, (name, rank, loss_diff)
            assert param_diff < PARAM_RTOL, (name, rank, param_diff)
            # The tied matrix (embedding or head copy) is under the one global name; in the V
            # placement rank 0 holds the first and the last stage, rank 1 neither.
            holds_tied = name == "pp2-1f1b" or rank == 0
            assert ("embed_tokens.weight" in got["params"]) == holds_tied, (name, rank)
            assert "lm_head.weight" not in got["params"], (name, rank)


def _save_after(rank: int, world_size: int, flags: list[str], save: str, steps: int) -> list:
    trainer = Trainer(
        parse_args([*BASE, *TIED, "--train-iters", str(CKPT_STEPS), "--save", save, *flags])
    )
    losses = [trainer.train_step().loss for _ in range(steps)]
    trainer.save()
    trainer.checkpoints.wait()
    return losses


def _resume_one(rank: int, world_size: int, flags: list[str], load: str) -> float:
    trainer = Trainer(
        parse_args([*BASE, *TIED, "--train-iters", str(CKPT_STEPS), "--load", load, *flags])
    )
    trainer.load()
    return trainer.train_step().loss


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "resumed"), [(PP2, []), ([], PP2)], ids=["pp2-to-single", "single-to-pp2"]
)
def test_tied_checkpoint_moves_between_pipeline_and_single(
    tmp_path: Path, saved: list[str], resumed: list[str]
):
    reference = run_distributed(_save_after, 1, [], str(tmp_path / "ref"), CKPT_STEPS)[0]
    save = str(tmp_path / "ckpt")
    first = run_distributed(_save_after, 2 if saved else 1, saved, save, CKPT_STEPS - 1)[0]
    assert first == pytest.approx(reference[: CKPT_STEPS - 1], rel=LOSS_RTOL)
    resumed_losses = run_distributed(_resume_one, 2 if resumed else 1, resumed, save)
    assert resumed_losses == pytest.approx([reference[-1]] * len(resumed_losses), rel=LOSS_RTOL)
