"""The device check's FP8 phase (bench/device_fp8.py): its flags, its worker on the smoke shape,
the comparison against bf16 --compile, and the phase end to end through bench.device_check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import device_fp8
from bench.device_workers import SHAPES
from services.trainer.arguments import parse_args

REPO = Path(__file__).resolve().parents[2]


def test_gpu_sides_are_the_checks_compiled_bf16_run_plus_fp8():
    shape = SHAPES["gpu"]
    base = device_fp8.side_flags("bf16-compile", shape, "gpu", loss_run=False)
    fp8 = device_fp8.side_flags("fp8-rowwise", shape, "gpu", loss_run=False)
    assert "--compile" in base and "--bf16" in base and "--fp8" not in base
    assert fp8 == [*base, "--fp8", "rowwise"]
    config = parse_args(fp8).validate()
    assert config.precision.fp8 == "rowwise" and config.model.seq_length == 2048
    loss = parse_args(device_fp8.side_flags("fp8-tensorwise", shape, "gpu", loss_run=True))
    assert loss.batch.global_batch_size == shape["mbs"] and loss.run.train_iters == 200


def test_the_worker_measures_throughput_and_the_loss_run_on_the_smoke_shape():
    row = device_fp8.fp8_worker("fp8-tensorwise", "smoke")
    assert row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["graph_breaks"] == 0
    assert len(row["losses_every_10"]) == device_fp8.LOSS_STEPS["smoke"] // 10
    assert 0 < row["loss_200"] < 6  # ln(256) = 5.55 at the start
    with pytest.raises(ValueError, match="fp8 side 'fp8-mx'"):
        device_fp8.fp8_worker("fp8-mx", "smoke")


def test_compare_reports_speedup_and_loss_gap_and_only_a_gpu_run_meets_targets():
    def row(tokens_per_s: float, loss: float) -> dict[str, float]:
        return {"tokens_per_s": tokens_per_s, "loss_200": loss, "mfu": 0.5, "peak_memory_gib": 1}

    sides = {
        "bf16-compile": row(1000.0, 2.500),
        "fp8-tensorwise": row(1300.0, 2.505),
        "fp8-rowwise": row(1200.0, 2.520),
    }
    page = "\n".join(
        device_fp8.markdown_lines({"sides": sides, "compare": device_fp8.compare(sides, "gpu")})
    )
    assert "| fp8-tensorwise | 1,300 | 50.0% | 1.00 | 2.5050 | 1.30x | 0.0050 | yes |" in page
    assert "| fp8-rowwise | 1,200 | 50.0% | 1.00 | 2.5200 | 1.20x | 0.0200 | no |" in page
    gpu = device_fp8.compare(sides, "gpu")
    assert gpu["fp8-tensorwise"]["speedup"] == pytest.approx(1.3)
    assert gpu["fp8-tensorwise"]["loss_gap"] == pytest.approx(0.005)
    assert gpu["fp8-tensorwise"]["meets_target"] is True
    assert gpu["fp8-rowwise"]["meets_target"] is False  # 1.2x and a 0.02 gap
    assert device_fp8.compare(sides, "smoke")["fp8-tensorwise"]["meets_target"] is None
    failed = {**sides, "bf16-compile": {"error": "timed out after 200 s"}}
    assert device_fp8.compare(failed, "gpu") == {}
    lines = device_fp8.markdown_lines({"sides": failed, "compare": {}})
    assert any("| bf16-compile | timed out after 200 s |" in line for line in lines)


@pytest.mark.slow  # three worker processes (~70 s on the busy 2-core box)
def test_the_fp8_phase_runs_alone_and_lands_in_the_report(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.device_check", "--smoke", "--phases", "fp8",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["phases"] == ["fp8"]
    assert set(report["fp8"]["sides"]) == set(device_fp8.SIDES)
    assert set(report["fp8"]["compare"]) == {"fp8-tensorwise", "fp8-rowwise"}
    page = (tmp_path / "report.md").read_text()
    assert "| fp8-rowwise |" in page and "loss within 0.01 at step 200" in page
