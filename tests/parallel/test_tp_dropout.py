"""Dropout under tensor parallelism: shared masks on replicated activations, own masks on shards.

One 2-process gloo launch (TP2, tiny-llama-gqa, hidden and attention dropout 0.2):
- without sequence parallelism every decoder layer's output (the replicated residual stream) is
  the same on both TP ranks — with a per-rank dropout stream they drift apart;
- random draws inside attention (heads sharded) differ between the ranks, and with sequence
  parallelism so do draws inside the decoder layers (sequence shards), while draws outside the
  sharded regions agree;
- full and selective recompute redraw the forward's masks: losses and parameters equal the run
  without recompute.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from models.transformer import Attention, DecoderLayer
from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.parallel.parity import BASE, full_parameters
from training.loop import Trainer

pytestmark = pytest.mark.dist

DROPOUT = ["--tensor-model-parallel-size", "2", "--hidden-dropout", "0.2",
           "--attention-dropout", "0.2"]  # fmt: skip


def _trainer(flags: list[str], steps: int) -> Trainer:
    return Trainer(parse_args([*BASE, "--train-iters", str(steps), *DROPOUT, *flags]))


def _probe_one_step(flags: list[str]) -> dict[str, Any]:
    """One step with hooks that record layer outputs and draws inside/outside the regions."""
    trainer = _trainer(flags, 1)
    seen: dict[str, list[torch.Tensor]] = {"outputs": [], "in_attention": [], "at_layer": []}

    def draw(key: str) -> Any:
        return lambda module, args: seen[key].append(torch.rand(4))

    for module in trainer.model.modules():
        # Registered after the trainer's own hooks, so these run inside the regions.
        if isinstance(module, Attention):
            module.register_forward_pre_hook(draw("in_attention"))
        if isinstance(module, DecoderLayer):
            module.register_forward_pre_hook(draw("at_layer"))
            module.register_forward_hook(lambda m, a, out: seen["outputs"].append(out.detach()))
    loss = trainer.train_step().loss
    return {"loss": loss, **{k: torch.stack(v) for k, v in seen.items()}}


def _run(flags: list[str], steps: int) -> dict[str, Any]:
    trainer = _trainer(flags, steps)
    losses = [trainer.train_step().loss for _ in range(steps)]
    return {"losses": losses, "params": full_parameters(trainer.model)}


def _body(rank: int, world_size: int) -> dict[str, Any]:
    sp = ["--sequence-parallel"]
    return {
        "tp": _probe_one_step([]),
        "tp_sp": _probe_one_step(sp),
        "none": _run(sp, 3),
        "full": _run([*sp, "--recompute-granularity", "full"], 3),
        "selective": _run([*sp, "--recompute-granularity", "selective"], 3),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_body, 2)


def test_replicated_stream_is_identical_across_tp_ranks(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks[0]["tp"], ranks[1]["tp"]
    assert torch.equal(first["outputs"], second["outputs"])
    assert torch.equal(first["at_layer"], second["at_layer"])
    # ...while attention, whose heads are sharded, runs on a stream of each rank's own.
    assert not torch.equal(first["in_attention"], second["in_attention"])


def test_sequence_parallel_layers_draw_per_rank(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks[0]["tp_sp"], ranks[1]["tp_sp"]
    assert not torch.equal(first["at_layer"], second["at_layer"])
    assert not torch.equal(first["in_attention"], second["in_attention"])


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_redraws_the_same_masks(ranks: list[dict[str, Any]], granularity: str) -> None:
    for rank in ranks:
        base, recomputed = rank["none"], rank[granularity]
        assert recomputed["losses"] == pytest.approx(base["losses"], rel=1e-6)
        for name, value in base["params"].items():
            torch.testing.assert_close(recomputed["params"][name], value, rtol=1e-6, atol=1e-7)
