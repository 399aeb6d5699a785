"""Adaptive recompute: the plan fits the budget with the fewest layers, and training is unchanged."""

from __future__ import annotations

import pytest

from parallel.adaptive_recompute import choose_layers
from services.trainer.arguments import parse_args
from tests.parallel.parity import BASE
from training.loop import Trainer

MB = 2**20


def test_plan_takes_largest_layers_until_it_fits():
    acts = {0: 10 * MB, 1: 30 * MB, 2: 20 * MB}
    assert choose_layers(acts, 100 * MB, 200 * MB).layers == []
    # 100 + 60 = 160 > 150: recompute layer 1 -> 100 + 30 + 30 = 160, then 2 -> 100 + 10 + 30.
    plan = choose_layers(acts, 100 * MB, 150 * MB)
    assert plan.layers == [1, 2]
    assert plan.predicted_peak == 140 * MB
    assert choose_layers(acts, 100 * MB, 145 * MB).predicted_peak == 140 * MB
    hopeless = choose_layers(acts, 500 * MB, 150 * MB)
    assert hopeless.layers == [0, 1, 2] and hopeless.predicted_peak > 150 * MB


def test_flags_are_validated():
    with pytest.raises(ValueError, match="--auto-recompute-profiling-step must be >= 5"):
        parse_args(
            [*BASE, "--auto-recompute-device-size", "100", "--auto-recompute-profiling-step", "3"]
        )
    with pytest.raises(ValueError, match="drop --recompute-granularity"):
        parse_args(
            [*BASE, "--auto-recompute-device-size", "100", "--recompute-granularity", "full"]
        )


def _run(flags: list[str]) -> tuple[Trainer, list[float]]:
    trainer = Trainer(parse_args([*BASE, "--train-iters", "7", *flags]))
    return trainer, [trainer.train_step().loss for _ in range(7)]


@pytest.mark.slow
def test_tight_budget_recomputes_every_layer_and_keeps_the_losses():
    _, plain = _run([])
    # A 1 MB budget cannot hold even the weights: every layer must recompute (with a warning).
    trainer, losses = _run(
        ["--auto-recompute-device-size", "1", "--auto-recompute-profiling-step", "5"]
    )
    plan = trainer.auto_recompute.plan
    assert plan is not None and plan.layers == [0, 1, 2, 3]
    assert all(trainer.auto_recompute.activations[i] > 0 for i in range(4))
    assert losses == pytest.approx(plain, rel=1e-6)
