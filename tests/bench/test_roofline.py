"""The decode-roofline phase's CPU-side logic (bench/roofline.py, bench/device_decode.py): the
bytes-per-token formula against the model Meshline builds and Llama-3-8B's published parameter
count, the report's lines for a full, a cut-short and a failed run, and that a smoke run never
marks a GPU target met. The GPU figures themselves need a device (`make device-check`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.device_decode import SHAPES, model_config, release_memory, served_step_seconds
from bench.loadgen_metrics import RequestRecord
from bench.roofline import (
    LLAMA_8B,
    kv_bytes,
    markdown,
    mean_context,
    roofline,
    vendor_bandwidth,
    verdict,
    weight_bytes,
)

REPO = Path(__file__).resolve().parents[2]
LLAMA3_8B_PARAMETERS = 8_030_261_248
"""Meta's Llama-3-8B parameter count (embedding 128256 x 4096 included, head untied)."""


def streamed_parameters(shape: dict[str, int]) -> int:
    """Parameters of the model Meshline builds for `shape` (on the meta device), less the
    embedding a decode step only gathers from."""
    from models import build_model

    model = build_model(model_config(shape), device="meta")
    return sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")


@pytest.mark.parametrize("mode", ["gpu", "smoke"])
def test_weight_bytes_are_the_built_models_streamed_weights(mode):
    shape = SHAPES[mode]
    assert weight_bytes(shape, 2) == 2 * streamed_parameters(shape)


def test_weight_bytes_match_llama3_8b():
    embedding = LLAMA_8B["vocab"] * LLAMA_8B["hidden"]
    assert weight_bytes(LLAMA_8B, 1) == LLAMA3_8B_PARAMETERS - embedding
    assert weight_bytes(LLAMA_8B, 2) == 15_009_849_344  # ~15.0 GB streamed per bf16 token


def test_kv_bytes_and_the_roofline():
    # K and V, 32 layers, 8 KV heads of 128, bf16: 128 KiB per cached position
    assert kv_bytes(LLAMA_8B, 1, 2) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert mean_context(LLAMA_8B) == 128 + 64
    row = roofline(LLAMA_8B, 2, bandwidth=4.0e12, measured_s=5e-3)
    total = 15_009_849_344 + 131_072 * 192
    assert row["bytes_per_token"] == total
    assert row["roofline_ms"] == pytest.approx(total / 4.0e12 * 1e3)  # ~3.76 ms
    assert row["fraction"] == pytest.approx(total / 4.0e12 / 5e-3)  # ~75%
    assert "15.010 GB weights" in row["formula"] and "4.000 TB/s" in row["formula"]
    assert row["formula"].endswith(f"{row['fraction']:.1%}")


def test_served_step_is_the_difference_of_whole_requests():
    """A 16-token request taking 0.1 + 15 x 0.004 s and a 1-token one 0.1 s: 4 ms a step,
    however the chunks were bunched (all 16 arrive at the end here)."""

    async def send(prompt: list[int], tokens: int) -> RequestRecord:
        wall = 0.1 + (tokens - 1) * 0.004
        return RequestRecord(10.0, [10.0 + wall] * tokens, [1] * tokens, 10.0 + wall)

    run = asyncio.run
    assert served_step_seconds(run, send, [4, 5], 16) == pytest.approx(0.004)

    async def eos_at_once(prompt: list[int], tokens: int) -> RequestRecord:
        return RequestRecord(0.0, [0.1], [1], 0.1)

    with pytest.raises(RuntimeError, match="stopped after 1 token"):
        served_step_seconds(run, eos_at_once, [4], 16)


def test_release_memory_empties_the_accelerator_cache_only():
    """The CUDA path with CUDA mocked: `Platform.module` is a property, not a method."""
    emptied = []
    cuda = SimpleNamespace(
        type="cuda", module=SimpleNamespace(empty_cache=lambda: emptied.append(1))
    )
    release_memory(cuda)
    assert emptied == [1]
    release_memory(SimpleNamespace(type="cpu", module=None))  # nothing to empty on the CPU
    from kernels import device

    release_memory(device.current())  # the real platform object of this machine


def test_vendor_bandwidth_by_name():
    assert vendor_bandwidth("NVIDIA H200") == 4.8e12
    assert vendor_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert vendor_bandwidth("AMD EPYC 7B13") is None


def test_only_a_gpu_run_marks_a_target():
    assert verdict("gpu", 0.85, 0.8) == "met"
    assert verdict("gpu", 0.5, 0.8) == "not met"
    assert verdict("smoke", 0.99, 0.8).startswith("open")
    assert verdict("gpu", None, 0.8).startswith("open")


def full_result() -> dict:
    return {
        "shape": LLAMA_8B,
        "dtype": "bfloat16",
        "bandwidth": {"measured_bytes_s": 4.2e12, "vendor_bytes_s": 4.8e12},
        "batch1": roofline(LLAMA_8B, 2, 4.2e12, 4.0e-3),
        "batches": [{"rows": 8, "step_ms": 4.5, "tokens_per_s": 8 / 4.5e-3}],
        "served": {"grpc": {"ms": 4.1, "ratio": 4.0 / 4.1}, "http": {"error": "refused"}},
        "loadgen": {"markdown": "## http\n\n| streams |\n"},
    }


def test_report_lines_for_a_full_run():
    page = "\n".join(markdown(full_result(), "gpu"))
    assert "4.200 TB/s (88% of the vendor's 4.80)" in page
    assert "target >= 80%: met" in page  # 3.58 ms bound / 4.0 ms measured
    assert "| 8 | 1,778 | 4.50 |" in page
    assert "| grpc | 4.100 | 0.976 (met) |" in page and "| http | refused | |" in page
    assert "## http" in page
    smoke = "\n".join(markdown(full_result(), "smoke"))
    assert "met" not in smoke.replace("not met", "")  # a CPU run leaves every target open
    assert "open (no GPU measurement)" in smoke


def test_report_lines_for_a_cut_short_and_a_failed_run():
    cut = {k: v for k, v in full_result().items() if k in ("shape", "dtype", "bandwidth")}
    cut["incomplete"] = "timed out after 330 s"
    page = "\n".join(markdown(cut, "gpu"))
    assert "cut short (timed out after 330 s)" in page and "TB/s" in page
    assert "batch 1" not in page
    assert markdown({"error": "skipped: the check's time budget was spent"}, "gpu")[-1] == (
        "Decode roofline: skipped: the check's time budget was spent"
    )


def test_device_check_help_and_phase_names_on_cpu(tmp_path):
    command = [sys.executable, "-m", "bench.device_check"]
    shown = subprocess.run([*command, "--help"], cwd=REPO, capture_output=True, text=True)
    assert shown.returncode == 0 and "roofline" in shown.stdout, shown.stderr
    bad = subprocess.run(
        [*command, "--smoke", "--out", str(tmp_path), "--phases", "roofline,warp"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "decode,fp8,roofline" in bad.stderr


@pytest.mark.slow
def test_smoke_roofline_phase_runs_end_to_end(tmp_path):
    """The whole phase on tiny shapes on the CPU: in-process decode, the checkpoint served by a
    real server process, gRPC/HTTP timing and the loadgen; figures exist, targets stay open."""
    command = [sys.executable, "-m", "bench.device_check", "--smoke", "--phases", "roofline"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "report.json").read_text())["roofline"]
    assert result["bandwidth"]["measured_bytes_s"] > 0 and result["batch1"]["fraction"] > 0
    assert [row["rows"] for row in result["batches"]] == [2, 4]
    for name in ("grpc", "http"):
        # On the CPU smoke shape a token costs well under a millisecond, so a front may read
        # only noise; it then says so rather than report a time (a GPU run's tokens are longer).
        entry = result["served"][name]
        assert entry.get("ms", 0) > 0 or "timing noise" in entry.get("error", ""), result["served"]
    levels = result["loadgen"]["report"]["transports"]["http"]
    assert [level["errors"] for level in levels] == [0, 0]
    page = (tmp_path / "report.md").read_text()
    assert "Decode roofline" in page and "open (no GPU measurement)" in page
    assert not (tmp_path / "roofline" / "roofline-ckpt").exists()  # the checkpoint is removed
