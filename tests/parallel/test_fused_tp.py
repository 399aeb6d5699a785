"""Fused qkv and [gate; up] weights under TP: each rank stores 1/tp of them, the loss curve
equals one process, and checkpoints move between TP2 and one process both ways.

tiny-llama-gqa (fused qkv and gate_up, 4 heads, 2 KV heads) in the parity setup of `parity.py`.
Rank 0 saves after 3 steps and runs a 4th; the other layout resumes from that checkpoint and its
4th step must give the same loss and the same parameters (tolerances as in test_parity.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.parallel.parity import (
    BASE,
    full_parameters,
    max_loss_diff,
    max_param_diff,
)
from tests.parallel.test_parity import LOSS_RTOL, PARAM_RTOL
from training.loop import Trainer

SAVED_STEPS = 3
TP2 = ["--tensor-model-parallel-size", "2"]
FUSED = ("qkv_proj.weight", "gate_up_proj.weight")


def _train(rank: int, world_size: int, flags: list[str], save: str, load: str) -> dict[str, Any]:
    """Without `load`: SAVED_STEPS steps, save, one more step. With `load`: resume, one step."""
    from torch.distributed.tensor import DTensor

    argv = [*BASE, "--train-iters", str(SAVED_STEPS + 1), "--save", save, *flags]
    trainer = Trainer(parse_args([*argv, "--load", load] if load else argv))
    stored = {
        name: (p.to_local().numel() if isinstance(p, DTensor) else p.numel(), p.numel())
        for name, p in trainer.model.named_parameters()
        if name.endswith(FUSED)
    }
    losses = []
    if load:
        trainer.load()
    else:
        losses = [trainer.train_step().loss for _ in range(SAVED_STEPS)]
        trainer.save()
        trainer.checkpoints.wait()
    losses.append(trainer.train_step().loss)
    return {"losses": losses, "stored": stored, "params": full_parameters(trainer.model)}


@pytest.mark.dist
@pytest.mark.slow
def test_fused_weights_sharded_match_one_process_and_resume_across_layouts(tmp_path: Path):
    single_dir, tp_dir = str(tmp_path / "single"), str(tmp_path / "tp2")
    single = run_distributed(_train, 1, [], single_dir, "")[0]
    tp2 = run_distributed(_train, 2, TP2, tp_dir, "")
    for rank, got in enumerate(tp2):
        assert len(got["stored"]) == 8, got["stored"]  # 4 layers x (qkv, gate_up)
        for name, (local, total) in got["stored"].items():
            assert local * 2 == total, (rank, name, local, total)
        loss_diff = max_loss_diff(single["losses"], got["losses"])
        param_diff = max_param_diff(single["params"], got["params"])
        print(f"tp2 rank {rank}: loss rel {loss_diff:.2e}, params rel {param_diff:.2e}")
        assert loss_diff < LOSS_RTOL and param_diff < PARAM_RTOL, (rank, loss_diff, param_diff)
    # Each layout resumes from the other's step-3 checkpoint; the 4th step is the reference's.
    resumed = {
        "tp2 -> 1": run_distributed(_train, 1, [], str(tmp_path / "a"), tp_dir),
        "1 -> tp2": run_distributed(_train, 2, TP2, str(tmp_path / "b"), single_dir),
    }
    for name, results in resumed.items():
        for got in results:
            loss_diff = max_loss_diff(single["losses"][-1:], got["losses"])
            param_diff = max_param_diff(single["params"], got["params"])
            print(f"{name}: loss rel {loss_diff:.2e}, params rel {param_diff:.2e}")
            assert loss_diff < LOSS_RTOL and param_diff < PARAM_RTOL, (name, loss_diff, param_diff)
