"""Peak FLOP/s by device model (the MFU denominator) and the CPU measurement."""

from __future__ import annotations

import logging

import pytest

from kernels import device, peak_flops


@pytest.mark.parametrize(
    ("device_type", "name", "tflops"),
    [
        ("cuda", "NVIDIA A100-SXM4-80GB", 312.0),
        ("cuda", "NVIDIA A100 80GB PCIe", 312.0),
        ("cuda", "NVIDIA H100 80GB HBM3", 989.0),
        ("cuda", "NVIDIA H100 PCIe", 756.0),
        ("cuda", "NVIDIA H100 NVL", 835.0),
        ("cuda", "NVIDIA H200", 989.0),
        ("cuda", "NVIDIA H20", 148.0),
        ("cuda", "NVIDIA L40S", 362.0),
        ("cuda", "NVIDIA L40", 181.0),
        ("cuda", "NVIDIA L4", 121.0),
        ("npu", "Ascend910B1", 414.0),
        ("npu", "Ascend910B2", 376.0),
        ("npu", "Ascend910B2C", 376.0),
        ("npu", "Ascend910B3", 313.0),
        ("npu", "Ascend910B4", 280.0),
    ],
)
def test_table_by_device_model(device_type: str, name: str, tflops: float) -> None:
    found = peak_flops.lookup(device_type, name)
    assert found is not None and found.tflops == tflops


def test_unknown_and_cpu_names_have_no_table_entry() -> None:
    assert peak_flops.lookup("cuda", "NVIDIA GeForce GTX 1080") is None
    assert peak_flops.lookup("cpu", "Intel(R) Xeon(R) Platinum 8480+") is None


def test_override_wins_and_must_be_positive() -> None:
    assert peak_flops.peak_tflops(123.0) == peak_flops.PeakFlops(123.0, "--peak-tflops")
    with pytest.raises(ValueError, match="--peak-tflops"):
        peak_flops.peak_tflops(0.0)


def test_cpu_peak_is_measured_once() -> None:
    if device.current().type != "cpu":
        pytest.skip("the measured peak is the CPU path")
    first = peak_flops.peak_tflops()
    assert first.source.startswith("measured")
    # 2 * 512^3 flops in a positive time: above 1 MFLOP/s and below 1 PFLOP/s on any CPU.
    assert 1e-6 < first.tflops < 1e3
    assert peak_flops.peak_tflops() is first


def test_unknown_accelerator_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class FakeCuda(device.CudaPlatform):
        def device_name(self) -> str:
            return "NVIDIA Future GPU"

    monkeypatch.setattr(device, "current", lambda: FakeCuda())
    with caplog.at_level(logging.WARNING, logger="kernels.peak_flops"):
        found = peak_flops.peak_tflops()
    assert found.tflops == 312.0
    assert "--peak-tflops" in caplog.text


def test_cpu_measurement_keeps_the_best_of_spaced_repeats() -> None:
    pauses: list[float] = []
    durations = iter([4.0, 1.0, 3.0, 2.0, 5.0] * 2)  # seconds per timed matmul (start, stop)
    now = [0.0, False]

    def clock() -> float:
        if now[1]:
            now[0] += next(durations)
        now[1] = not now[1]
        return now[0]

    found = peak_flops.measure_cpu(size=8, repeats=5, clock=clock, pause=pauses.append)
    assert found.tflops == pytest.approx(2 * 8**3 / 1.0 / 1e12)
    assert found.spread == 3.0  # median repeat over best
    assert pauses == [peak_flops.SPACING_S] * 4  # between repeats, not before the first


def test_a_busy_cpu_measurement_is_recorded_in_the_source(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    peak_flops._measured_cpu_peak.cache_clear()
    monkeypatch.setattr(peak_flops, "measure_cpu", lambda: peak_flops.CpuMeasurement(0.02, 3.0))
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.peak_flops"):
            found = peak_flops._measured_cpu_peak()
        assert found.tflops == 0.02 and "busy machine: repeats varied 3.0x" in found.source
        assert "--peak-tflops" in caplog.text
    finally:
        peak_flops._measured_cpu_peak.cache_clear()
