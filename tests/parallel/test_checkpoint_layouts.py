"""Checkpoints saved under one parallel layout resume under another with the same next step.

DCP keeps global parameter names on every layout (pipeline chunks keep `layers.<i>`, TP shards are
DTensors, ZeRO-1 state of a TP parameter is a DTensor on a (tp, dp) mesh), so nothing is converted
offline. Each layout saves after STEPS - 1 steps (one 4-rank launch); each resume takes the last
step (another). Cross-layout resumes must give the loss the uninterrupted single-process run has at
that step and, after it, its parameters (the update reads the loaded optimizer state; the loss
does not), within the parity tests' tolerances. TP2×DP2 ZeRO-1 resumed under its own layout must
match its own uninterrupted run exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.parallel.parity import BASE, full_parameters, max_param_diff
from training.loop import Trainer

STEPS = 3
LOSS_RTOL, PARAM_RTOL = 1e-5, 1e-4
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DP4 = ["--zero-stage", "1"]
TP2_ZERO1 = ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]
TP2_ZERO3 = ["--tensor-model-parallel-size", "2", "--zero-stage", "3"]
SAVED = {"tp2pp2": TP2_PP2, "dp4-zero1": DP4, "tp2-zero1-dp2": TP2_ZERO1}
# name -> (layout to resume under, checkpoint to load)
RESUMED = {
    "tp2pp2-to-dp4": (DP4, "tp2pp2"),
    "dp4-to-tp2pp2": (TP2_PP2, "dp4-zero1"),
    "tp2-zero1-same-layout": (TP2_ZERO1, "tp2-zero1-dp2"),
    "tp2-zero1-to-tp2-zero3": (TP2_ZERO3, "tp2-zero1-dp2"),
    "dp4-zero1-to-tp2-zero1": (TP2_ZERO1, "dp4-zero1"),
}
ONE_PROCESS_LOADS = ("tp2-zero1-dp2",)


def _trainer(flags: list[str], *extra: str) -> Trainer:
    return Trainer(parse_args([*BASE, "--train-iters", str(STEPS), *extra, *flags]))


def _step(trainer: Trainer) -> dict[str, Any]:
    loss = trainer.train_step().loss
    return {"loss": loss, "params": full_parameters(trainer.model)}


def _save_all(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    """Save every SAVED layout after STEPS - 1 steps, then take its uninterrupted last step."""
    out = {}
    for name, flags in SAVED.items():
        trainer = _trainer(flags, "--save", str(Path(root) / name))
        for _ in range(STEPS - 1):
            trainer.train_step()
        trainer.save()
        trainer.checkpoints.wait()
        out[name] = _step(trainer)
    return out


def _resume_all(rank: int, world_size: int, root: str, cases: dict) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (flags, source) in cases.items():
        trainer = _trainer(flags, "--load", str(Path(root) / source))
        assert trainer.load() == STEPS - 1
        out[name] = _step(trainer)
    return out


def _reference_and_one_process_loads(rank: int, world_size: int, root: str) -> dict[str, Any]:
    trainer = _trainer([])
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    reference = {"losses": losses, "params": full_parameters(trainer.model)}
    resumed = _resume_all(rank, world_size, root, {s: ([], s) for s in ONE_PROCESS_LOADS})
    return {"reference": reference, "resumed": resumed}


def _assert_matches_reference(name: str, got: dict[str, Any], reference: dict[str, Any]) -> None:
    assert got["loss"] == pytest.approx(reference["losses"][-1], rel=LOSS_RTOL), name
    diff = max_param_diff(reference["params"], got["params"])
    assert diff <= PARAM_RTOL, f"{name}: parameters after the resumed step off by {diff:.2e}"


@pytest.mark.dist
@pytest.mark.slow
def test_resume_across_layouts(tmp_path: Path):
    root = str(tmp_path)
    saved = run_distributed(_save_all, 4, root)
    resumed = run_distributed(_resume_all, 4, root, RESUMED)
    single = run_distributed(_reference_and_one_process_loads, 1, root)[0]
    reference = single["reference"]

    for name in SAVED:
        for rank in range(4):
            _assert_matches_reference(
                f"{name} uninterrupted, rank {rank}", saved[rank][name], reference
            )
    for name, (flags, source) in RESUMED.items():
        for rank in range(4):
            got = resumed[rank][name]
            _assert_matches_reference(f"{name}, rank {rank}", got, reference)
            if flags == SAVED[source]:
                assert got["loss"] == saved[rank][source]["loss"], name
                for key, value in saved[rank][source]["params"].items():
                    assert value.equal(got["params"][key]), f"{name}, rank {rank}: {key} differs"
    for source in ONE_PROCESS_LOADS:
        _assert_matches_reference(f"{source} -> one process", single["resumed"][source], reference)
