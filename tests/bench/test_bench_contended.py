"""bench_contended's fixed background load starts and is killed with its block, and the ratios
it reads are the paired figures the two benches print."""

from __future__ import annotations

import pytest

from bench import bench_contended


def test_background_load_runs_only_inside_its_block() -> None:
    with bench_contended.background_load(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
    with pytest.raises(RuntimeError), bench_contended.background_load(1) as procs:
        raise RuntimeError("a bench failed")
    assert procs[0].returncode is not None  # killed on the way out of a failure too


def test_reads_the_benches_paired_ratios() -> None:
    train = (
        "hidden 256 x 4 layers, seq 256, mbs 4, 6 steps: tokens/s median ours 9,000 HF 7,000 "
        "-> 1.29x; best step ours 9,500 HF 7,400 -> 1.28x; paired (round medians) 1.27x "
        "[1.25, 1.30]"
    )
    serve = (
        "hidden 256 batch 1 (grpc): ms per token per request, ours min 0.83 median 0.95, HF min "
        "4.79 median 5.57 -> HF/ours min 5.77x, median 5.86x, paired 5.85x"
    )
    assert bench_contended.TRAIN_PAIRED.findall(train) == ["1.27"]
    assert bench_contended.SERVE_PAIRED.findall(serve) == ["5.85"]


def test_refuses_a_run_without_load() -> None:
    with pytest.raises(SystemExit):
        bench_contended.main(["--load", "0"])
