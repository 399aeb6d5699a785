"""The preference stages under data parallelism (2 real gloo ranks) give the 1-process losses.

Each rank scores its share of the pairs, the pair counts and metric sums are all-reduced, and
DPO's reference (a frozen copy of the starting weights, made from the replicated model) is the
same on every rank: the loss curves and the logged quantities equal one process's.
"""

from __future__ import annotations

import pytest

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.training.test_alignment_train import _flags, pair_prefix  # noqa: F401
from training.loop import Trainer

CASES = {
    "rm": ("rm",),
    "dpo": ("dpo", "--dpo-beta", "0.5"),
    "dpo-zero1": ("dpo", "--use-distributed-optimizer"),
    "orpo": ("orpo",),
    "dpo-lora": ("dpo", "--lora-target-modules", "query_key_value", "--lora-r", "4"),
}


def _curve(flags: list[str]) -> list[tuple[float, dict[str, float]]]:
    records: list[dict] = []
    Trainer(parse_args(flags), on_metrics=records.append).fit()
    return [(r["loss"], r["objective"]) for r in records]


def _all(rank: int, world_size: int, base: dict[str, list[str]]) -> dict:
    return {name: _curve(flags) for name, flags in base.items()}


@pytest.mark.dist
@pytest.mark.slow
def test_dp2_preference_stages_match_one_process(sentencepiece_model, pair_prefix):  # noqa: F811
    runs = {
        name: _flags(sentencepiece_model, pair_prefix, stage, "--train-iters", "3", *extra)
        for name, (stage, *extra) in CASES.items()
    }
    results = run_distributed(_all, 2, runs)  # rank 0 logs the all-reduced numbers
    for name, flags in runs.items():
        single = _curve(flags)
        assert len(single) == 3
        for (loss, metrics), (loss_dp, metrics_dp) in zip(single, results[0][name], strict=True):
            # 2 pairs x 2 micro-batches x 2 ranks sum in another order than on one process
            assert loss_dp == pytest.approx(loss, rel=1e-5, abs=1e-6), name
            assert metrics_dp == pytest.approx(metrics, rel=1e-4, abs=1e-5), name
