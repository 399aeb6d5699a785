"""Overlap switches change when communication happens, never the numbers.

`--overlap-grad-reduce` under PP2 x DP2 (ZeRO-1: the all-reduce of a stage's gradients starts at
its last micro-batch backward; ZeRO-3: FSDP2 reduce-scatters each layer inside that backward)
and `--zero3-prefetch-layers 2` (explicit FSDP2 all-gather prefetch) must give the same loss
curve and final parameters as without, bit for bit: the same sums in the same order.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.parallel.parity import run_layout

STEPS = 3
PP2 = ["--pipeline-model-parallel-size", "2"]
OVERLAP = ["--overlap-grad-reduce"]
PAIRS = {
    "pp2-dp2-zero1": [*PP2, "--zero-stage", "1"],
    "pp2-dp2-zero3": [*PP2, "--zero-stage", "3"],
    "pp2-v2-dp2-zero1": [*PP2, "--num-layers-per-virtual-pipeline-stage", "1", "--zero-stage", "1"],
}


def _pairs(rank: int, world_size: int) -> dict[str, tuple[dict, dict]]:
    return {
        name: (
            run_layout(rank, world_size, flags, STEPS),
            run_layout(rank, world_size, [*flags, *OVERLAP], STEPS),
        )
        for name, flags in PAIRS.items()
    }


def _prefetch(rank: int, world_size: int) -> tuple[dict, dict]:
    flags = ["--tensor-model-parallel-size", "2", "--zero-stage", "3"]
    return (
        run_layout(rank, world_size, flags, STEPS),
        run_layout(rank, world_size, [*flags, "--zero3-prefetch-layers", "2"], STEPS),
    )


def _prefetch_dp(rank: int, world_size: int) -> tuple[dict, dict, list[int]]:
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE
    from training.loop import Trainer

    flags = ["--zero-stage", "3"]  # plain data parallelism: training.setup's path
    on = [*flags, "--zero3-prefetch-layers", "2"]
    # The switch is really set: layer i prefetches layers i+1, i+2 in forward.
    layers = Trainer(parse_args([*BASE, "--train-iters", "1", *on])).model.layers
    ahead = [len(layer._get_fsdp_state()._states_to_forward_prefetch) for layer in layers.values()]
    return (
        run_layout(rank, world_size, flags, STEPS),
        run_layout(rank, world_size, on, STEPS),
        ahead,
    )


def _assert_same(name: str, plain: dict, other: dict) -> None:
    assert plain["losses"] == other["losses"], name
    for key, value in plain["params"].items():
        assert torch.equal(value, other["params"][key]), (name, key)


@pytest.mark.dist
@pytest.mark.slow
def test_overlap_grad_reduce_is_exact():
    for by_name in run_distributed(_pairs, 4):
        for name, (plain, overlapped) in by_name.items():
            _assert_same(name, plain, overlapped)


@pytest.mark.dist
@pytest.mark.slow
def test_zero3_prefetch_is_exact():
    for plain, prefetched in run_distributed(_prefetch, 4):
        _assert_same("tp2-dp2-zero3", plain, prefetched)
    for plain, prefetched, ahead in run_distributed(_prefetch_dp, 2):
        assert ahead == [2, 2, 1, 0]
        _assert_same("dp2-zero3", plain, prefetched)
