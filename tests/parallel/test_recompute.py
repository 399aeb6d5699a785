"""Recompute changes memory, not math: full and selective give the plain run's loss curve."""

from __future__ import annotations

import pytest

from parallel.recompute import layers_to_recompute
from tests.parallel.parity import max_param_diff, run_layout

STEPS = 3


def test_block_method_picks_the_first_layers_of_the_stage():
    assert layers_to_recompute([4, 5, 6], "full", "block", 2) == [4, 5]
    assert layers_to_recompute([4, 5, 6], "full", "uniform", 1) == [4, 5, 6]
    assert layers_to_recompute([4, 5], "selective", None, None) == [4, 5]
    with pytest.raises(ValueError, match="--recompute-granularity"):
        layers_to_recompute([0], "partial", None, None)


@pytest.fixture(scope="module")
def plain() -> dict:
    return run_layout(0, 1, [], STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--recompute-granularity", "full", "--recompute-method", "uniform"],
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
        ],
        ["--recompute-activations"],
    ],
    ids=["full-uniform", "full-block-1", "selective"],
)
def test_recompute_matches_plain_run(flags, plain):
    got = run_layout(0, 1, flags, STEPS)
    # Recompute replays the same kernels on the same inputs: bitwise in practice, 1e-6 allowed.
    assert got["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert max_param_diff(plain["params"], got["params"]) < 1e-6
