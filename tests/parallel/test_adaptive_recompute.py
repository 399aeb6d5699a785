"""Adaptive recompute: the plan fits the budget with the fewest layers, and training is unchanged."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from kernels.device import MemoryStats
from parallel import adaptive_recompute
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
    # Step 6 ran under the plan in its own peak window (on CPU: the lifetime peak RSS).
    assert trainer.auto_recompute.measured_peak is not None
    assert trainer.auto_recompute.measured_peak > 1 * MB
    assert all(trainer.auto_recompute.activations[i] > 0 for i in range(4))
    assert losses == pytest.approx(plain, rel=1e-6)


class _FakeDevice:
    """kernels.device as the plan check reads it: a peak that a reset starts anew."""

    def __init__(self, allocated: int, step_peak: int) -> None:
        self.allocated, self.step_peak, self.resets, self.peak = allocated, step_peak, 0, 0

    def current(self) -> _FakeDevice:
        return self

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1
        self.peak = self.step_peak

    def memory_stats(self) -> MemoryStats:
        return MemoryStats("cuda", self.allocated, self.peak, 0)


@pytest.mark.parametrize(("step_peak", "over"), [(40 * MB, False), (90 * MB, True)])
def test_the_chosen_plan_is_checked_against_the_measured_peak(monkeypatch, caplog, step_peak, over):
    """The first step under the plan runs in a fresh peak window; its measured peak is logged
    beside the prediction and warned about when it exceeds --auto-recompute-device-size."""
    fake = _FakeDevice(allocated=10 * MB, step_peak=step_peak)
    monkeypatch.setattr(adaptive_recompute, "device", fake)
    layers = nn.ModuleDict({"0": nn.Linear(4, 4), "1": nn.Linear(4, 4)})
    auto = adaptive_recompute.AdaptiveRecompute(layers, budget_mb=64, profiling_steps=5)
    seen: list[str] = []
    for step in range(1, 6):
        auto.before_step()
        auto.after_step(step, seen.append)
    assert auto.plan is not None and auto.measured_peak is None and fake.resets == 0
    with caplog.at_level(logging.INFO, logger=adaptive_recompute.__name__):
        auto.before_step()
        auto.after_step(6, seen.append)
    assert fake.resets == 1 and auto.measured_peak == step_peak
    assert f"measured peak {step_peak / MB:.1f} MiB" in seen[-1]
    assert ("over --auto-recompute-device-size" in caplog.text) is over
    auto.before_step()  # later steps are not measured again
    auto.after_step(7, seen.append)
    assert fake.resets == 1 and len(seen) == 2
