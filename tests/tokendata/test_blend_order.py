"""Blend order is megatron-core's, step for step: the compiled loop (`blend_loop.c`) and the numpy
paths it replaces where no compiler was present (two datasets in closed form, three or more
guess-and-verify)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest

import tokendata.datasets.blended as blended
from tokendata.datasets.blend_order import blend_many, find_period, greedy_choices, sample_ids
from tokendata.datasets.blended import _blend_loop, build_blending_indices


@pytest.fixture(params=["compiled", "numpy"], autouse=True)
def blend_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test runs on both paths of `build_blending_indices`."""
    if request.param == "compiled" and blended.compiled_blend is None:
        pytest.skip("the compiled blend loop was not built here")
    if request.param == "numpy":
        monkeypatch.setattr(blended, "compiled_blend", None)
    yield request.param


def test_compiled_loop_is_built_where_a_compiler_exists(blend_path: str) -> None:
    """setuptools builds `blend_loop.c` as an optional extension: with a C compiler present (CI, the
    dev machine) a silent build failure would only show as a slower blend."""
    if blend_path == "numpy" or shutil.which("cc") is None:
        pytest.skip("checked once, where a C compiler exists")
    assert blended.compiled_blend is not None


def test_compiled_loop_refuses_bad_buffers(blend_path: str) -> None:
    if blend_path == "numpy":
        pytest.skip("compiled path only")
    picks, ids = np.empty(4, np.int16), np.empty(4, np.int64)
    with pytest.raises(ValueError, match="int16 buffer"):
        blended.compiled_blend.order(np.array([0.5, 0.5]).tobytes(), 5, picks, ids)
    with pytest.raises(ValueError, match="float64 weights"):
        blended.compiled_blend.order(b"", 4, picks, ids)


WEIGHT_SETS = [
    [0.3, 0.2, 0.5],
    [1 / 3, 1 / 3, 1 / 3],
    [0.1, 0.1, 0.1, 0.3, 0.4],
    [0.05, 0.6, 0.35],
    [0.01, 0.02, 0.97],
    [0.123, 0.456, 0.421],
    [0.3333, 0.3333, 0.3334],
    [0.2, 0.2, 0.2, 0.2, 0.2],
    [0.001, 0.001, 0.998],
    [0.5, 0.25, 0.125, 0.0625, 0.0625],
    [0.0, 0.4, 0.6],
]


def _megatron(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        dataset_index, sample_index, np.array(weights), len(weights), size, False
    )
    return dataset_index, sample_index


@pytest.mark.parametrize("weights", WEIGHT_SETS, ids=str)
def test_matches_megatron_helper_at_large_sizes(weights: list[float]) -> None:
    total = sum(weights)
    normalised = [w / total for w in weights]
    for size in (1_000_003, 1_234):
        expected = _megatron(normalised, size)
        got = build_blending_indices(normalised, size)
        assert got[0].dtype == np.int16 and got[1].dtype == np.int64
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_random_weights_match_the_loop() -> None:
    """Generic weights (no short period: the loop path), rounded ones (a period), odd sizes."""
    rng = np.random.default_rng(0)
    for case in range(60):
        n = int(rng.integers(3, 8))
        w = rng.dirichlet(np.full(n, 0.5 if case % 2 else 2.0))
        if case % 3 == 0:
            w = np.round(w, 2)
            w[-1] = max(0.0, 1.0 - w[:-1].sum())
        weights = [float(x) for x in w]
        size = int(rng.integers(1, 60_000))
        expected = _blend_loop(weights, size)
        got = build_blending_indices(weights, size)
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_array_equal(b, a, err_msg=f"{weights} {size}")


def test_unnormalised_weights_match_megatron() -> None:
    weights = [3.0, 1.0, 1.0, 5.0]  # BlendedDataset normalises; the function itself need not
    np.testing.assert_array_equal(
        build_blending_indices(weights, 50_000)[0], _megatron(weights, 50_000)[0]
    )


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.9, 0.1], [1.0]], ids=str)
def test_one_and_two_datasets_match_megatron(weights: list[float]) -> None:
    for size in (1, 2, 3, 58_878):
        got = build_blending_indices(weights, size)
        expected = _megatron(weights, size)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_verifier_finds_the_first_wrong_guess() -> None:
    weights = np.array([0.2, 0.3, 0.5])
    truth = _blend_loop(list(weights), 500)[0].astype(np.int64)
    assert np.array_equal(greedy_choices(weights, truth, np.zeros(3, np.int64), 0), truth)
    wrong = truth.copy()
    wrong[100] = (wrong[100] + 1) % 3
    choices = greedy_choices(weights, wrong, np.zeros(3, np.int64), 0)
    assert np.flatnonzero(choices != wrong)[0] == 100 and choices[100] == truth[100]
    tail = greedy_choices(weights, truth[200:], np.bincount(truth[:200], minlength=3), 200)
    assert np.array_equal(tail, truth[200:])


def test_period_and_sample_ids() -> None:
    assert find_period([0.3, 0.2, 0.5], 4096) == 10
    assert find_period([0.123, 0.456, 0.421], 4096) == 1000
    assert find_period([0.31830988618, 0.68169011382], 4096) is None
    picks = np.array([2, 0, 2, 1, 0, 2])
    assert sample_ids(picks, 3).tolist() == [0, 0, 1, 0, 1, 2]
    assert blend_many([0.3, 0.2, 0.5], 7).tolist() == _blend_loop([0.3, 0.2, 0.5], 7)[0].tolist()


@pytest.mark.parametrize("setting", [("_MIN_STEPS_PER_CHECK", 10**9), ("_REPAIRS", 0)])
def test_fallback_and_unrepaired_paths_are_exact(
    monkeypatch: pytest.MonkeyPatch, setting: tuple[str, int]
) -> None:
    """Giving up on guesses (the loop finishes) or never repairing them keeps the exact order."""
    import tokendata.datasets.blend_order as blend_order

    monkeypatch.setattr(blend_order, *setting)
    for weights in ([0.31, 0.27, 0.42], [0.1, 0.1, 0.1, 0.3, 0.4], [1 / 3, 1 / 3, 1 / 3]):
        size = 30_011
        assert np.array_equal(blend_many(weights, size), _blend_loop(weights, size)[0])
