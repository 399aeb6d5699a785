"""`--cpu-linear auto`'s probe on a busy machine: alternated rounds, best kept, and a probe
whose rounds vary too much keeps dense (logged) instead of a layout another process's timing
picked. The timer is injected, so the tests decide what each round "took"."""

from __future__ import annotations

import itertools
import logging

import pytest
from torch import nn

from engine import linear_choice


class ScriptedClock:
    """A timer whose successive (start, stop) pairs measure the given durations in turn."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = itertools.cycle(durations)
        self.started = False

    def __call__(self) -> float:
        if self.started:
            self.now += next(self.durations)
        self.started = not self.started
        return self.now


def test_rounds_alternate_the_layouts_and_keep_each_ones_best() -> None:
    order: list[str] = []
    layers = (lambda: order.append("a"), lambda: order.append("b"))
    # rounds (a, b): (4, 9), (2, 8), (3, 7), (2, 9), (3, 8) seconds for 2 calls each
    clock = ScriptedClock([4, 9, 2, 8, 3, 7, 2, 9, 3, 8])
    best, spread = linear_choice._time_alternated(layers, 2, clock)
    assert order[:2] == ["a", "b"]  # the warm-up call of each
    assert order[2:] == (["a"] * 2 + ["b"] * 2) * linear_choice.ROUNDS  # interleaved rounds
    assert best == [1.0, 3.5]
    assert spread == pytest.approx(max(3 / 2, 8 / 7))  # median round over best round


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))


def test_a_steady_probe_keeps_the_layout_it_measured(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(linear_choice, "pick_layout", lambda *a, **k: "packed")
    with caplog.at_level(logging.INFO, logger="engine.linear_choice"):
        assert linear_choice.choose_cpu_linear(_model(), clock=ScriptedClock([1e-3])) == "packed"
    assert "rounds within 1.00x" in caplog.text


def test_a_noisy_probe_keeps_dense_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(linear_choice, "pick_layout", lambda *a, **k: "packed")
    # Every layout's rounds: one at 1 ms, the others at 5 ms (another process held the core).
    noisy = ScriptedClock([1e-3, 1e-3, 1e-3, 5e-3, 5e-3, 5e-3] * 2 + [5e-3] * 3)
    with caplog.at_level(logging.WARNING, logger="engine.linear_choice"):
        assert linear_choice.choose_cpu_linear(_model(), clock=noisy) == "dense"
    assert "busy machine" in caplog.text and "instead of packed" in caplog.text
