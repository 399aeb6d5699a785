"""--fp8 under data parallelism (2 real gloo ranks): ZeRO-1 (autocast over fp32 parameters) and
ZeRO-3 (FSDP2 shards, bf16 compute) run FP8 linears and give the one-process losses."""

from __future__ import annotations

import pytest

from kernels.fp8_linear import Fp8Linear
from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from training.loop import Trainer

FLAGS = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--eval-interval", "0", "--lr", "1e-2", "--train-iters", "3",
         "--bf16"]  # fmt: skip
LAYOUTS = {
    "zero1-tensorwise": ["--zero-stage", "1", "--fp8", "tensorwise"],
    "zero3-rowwise": ["--zero-stage", "3", "--fp8", "rowwise"],
}


def _run(flags: list[str]) -> tuple[int, list[float]]:
    trainer = Trainer(parse_args(flags))
    fp8 = sum(isinstance(m, Fp8Linear) for m in trainer.model.modules())
    return fp8, [trainer.train_step().loss for _ in range(3)]


def _all_layouts(rank: int, world_size: int) -> dict[str, tuple[int, list[float]]]:
    return {name: _run([*FLAGS, *extra]) for name, extra in LAYOUTS.items()}


@pytest.mark.dist
@pytest.mark.slow
def test_dp2_fp8_layouts_match_one_process():
    results = run_distributed(_all_layouts, 2)
    assert results[0] == results[1]  # ranks agree on the (all-reduced) loss
    bf16 = _run(FLAGS)[1]
    for name, (fp8_layers, losses) in results[0].items():
        assert fp8_layers == 8, name  # every decoder linear of both layers, on every layout
        _, reference = _run([*FLAGS, *LAYOUTS[name]])
        # The same micro-batches are quantized the same way on 1 and 2 ranks; only the
        # gradient reduction order and bf16 rounding differ (as for bf16 without FP8).
        assert losses == pytest.approx(reference, rel=2e-3), name
        assert losses != bf16, name  # the FP8 matmuls did run
