"""`make device-check`'s smoke mode: the prepared GPU check runs end to end on a CPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_writes_a_complete_report(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.device_check", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "smoke"
    assert report["environment"]["peak_tflops"] > 0
    assert report["tests"]["passed"] > 0 and not report["tests"]["failed"]
    for side in ("hf", "ours"):
        row = report["train"][side]
        assert row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["tflops"] > 0, row
    assert report["decode"]["identical_greedy"] is True
    for rows in (1, 8):
        assert report["decode"][f"batch{rows}"]["ours_tokens_per_s"] > 0
    page = (tmp_path / "report.md").read_text()
    assert "| ours |" in page and "| batch 8 |" in page


def test_phases_run_a_subset(tmp_path: Path) -> None:
    """A rerun of one phase on a short lease: only decode runs; an unknown phase is refused."""
    cmd = [sys.executable, "-m", "bench.device_check", "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(
        [*cmd, "--phases", "decode"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["phases"] == ["decode"]
    assert "tests" not in report and report["train"] == {} and "kernels" not in report
    assert report["decode"]["batch1"]["ours_eager_tokens_per_s"] > 0
    bad = subprocess.run(
        [*cmd, "--phases", "decode,warp"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--phases takes names from" in bad.stderr


def test_make_target_runs_the_script() -> None:
    dry = subprocess.run(
        ["make", "-n", "device-check", "OUT=/tmp/x"], cwd=REPO, capture_output=True, text=True
    )
    assert dry.returncode == 0 and "-m bench.device_check --out /tmp/x" in dry.stdout
