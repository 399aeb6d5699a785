"""ALiBi (Bloom) models under tensor and context parallelism: loss curves equal one process.

tiny-bloom (ALiBi, fused qkv, embedding layernorm, tied embeddings) with 2 layers, otherwise the
parity setup of `parity.py`, 5 steps; tolerances as in test_parity.py. Under TP each rank keeps
heads [r·H/t, (r+1)·H/t) and must use those heads' slopes (with rank 0's slopes on every rank
the TP2 curve is off by ~3e-5 and the parameters by ~0.3); under CP each (query chunk, key
chunk) block gets the bias of the global positions.
"""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.parallel.parity import max_loss_diff, max_param_diff, run_layout
from tests.parallel.test_parity import LOSS_RTOL, PARAM_RTOL

STEPS = 5
BLOOM = ["--model", "tiny-bloom", "--num-layers", "2"]
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2": ["--context-parallel-size", "2"],
}


def _layouts(rank: int, world_size: int) -> dict[str, dict]:
    return {
        name: run_layout(rank, world_size, [*BLOOM, *flags], STEPS)
        for name, flags in LAYOUTS.items()
    }


@pytest.mark.dist
@pytest.mark.slow
def test_alibi_layouts_match_single_process():
    single = run_distributed(run_layout, 1, BLOOM, STEPS)[0]
    for rank, by_layout in enumerate(run_distributed(_layouts, 2)):
        for name, got in by_layout.items():
            loss_diff = max_loss_diff(single["losses"], got["losses"])
            param_diff = max_param_diff(single["params"], got["params"])
            print(f"{name} rank {rank}: loss rel {loss_diff:.2e}, params rel {param_diff:.2e}")
            assert set(got["params"]) == set(single["params"]), name
            assert loss_diff < LOSS_RTOL, (name, rank, loss_diff)
            assert param_diff < PARAM_RTOL, (name, rank, param_diff)
