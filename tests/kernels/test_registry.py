"""The op registry: per-device choice made once, MESHLINE_KERNELS overrides, clear errors."""

from __future__ import annotations

import pytest
import torch

from kernels import norm, registry


@pytest.fixture
def toy_op():
    op = registry.define("toy_test_op", lambda x: x + 1)
    op.register("fast_cpu", ("cpu",), lambda x: x + 1.0)
    op.register("npu_only", ("npu",), "kernels.npu.norm:rms_norm")
    op.register("broken_cpu", ("cpu",), "kernels.does_not_exist:fn")
    yield op
    del registry.OPS["toy_test_op"]
    registry._default_backend_name.cache_clear()


def test_default_is_first_backend_for_the_device(toy_op, monkeypatch):
    monkeypatch.delenv(registry.KERNELS_ENV, raising=False)
    assert toy_op.candidates("cpu") == ["fast_cpu", "broken_cpu", "reference"]
    assert toy_op.candidates("npu") == ["npu_only", "reference"]
    assert toy_op.default() == "fast_cpu"
    assert toy_op(torch.zeros(1)).item() == 1.0


def test_env_override_all_and_per_op(toy_op, monkeypatch):
    monkeypatch.setenv(registry.KERNELS_ENV, "reference")
    registry._default_backend_name.cache_clear()
    assert toy_op.default() == "reference"
    monkeypatch.setenv(registry.KERNELS_ENV, "toy_test_op=broken_cpu,rms_norm=reference")
    registry._default_backend_name.cache_clear()
    assert toy_op.default() == "broken_cpu"
    with pytest.raises(ModuleNotFoundError):
        toy_op(torch.zeros(1))
    monkeypatch.setenv(registry.KERNELS_ENV, "toy_test_op=warp_speed")
    registry._default_backend_name.cache_clear()
    with pytest.raises(ValueError, match="choose one of"):
        toy_op.default()


def test_a_backend_not_preferred_comes_after_the_reference(monkeypatch):
    """Registered (selectable by name and MESHLINE_KERNELS) but never the default."""
    monkeypatch.delenv(registry.KERNELS_ENV, raising=False)
    op = registry.define("toy_test_op3", lambda x: x + 1)
    try:
        op.register("slow_cpu", ("cpu",), lambda x: x + 2, preferred=False)
        op.register("fast_cpu", ("cpu",), lambda x: x + 3)
        assert op.candidates("cpu") == ["fast_cpu", "reference", "slow_cpu"]
        assert op.available("cpu") == ["fast_cpu", "reference", "slow_cpu"]
        assert op.default() == "fast_cpu"
        assert op(torch.zeros(1), backend="slow_cpu").item() == 2.0
        only_slow = registry.define("toy_test_op4", lambda x: x + 1)
        only_slow.register("slow_cpu", ("cpu",), lambda x: x + 2, preferred=False)
        assert only_slow.default() == "reference"
    finally:
        registry.OPS.pop("toy_test_op3", None)
        registry.OPS.pop("toy_test_op4", None)
        registry._default_backend_name.cache_clear()


def test_unavailable_backend_is_skipped(monkeypatch):
    monkeypatch.delenv(registry.KERNELS_ENV, raising=False)
    op = registry.define("toy_test_op2", lambda x: x)
    try:
        op.register("missing", ("cpu",), "kernels.does_not_exist:fn")
        assert op.default() == "reference"
    finally:
        del registry.OPS["toy_test_op2"]
        registry._default_backend_name.cache_clear()


def test_bad_registrations_and_override_syntax():
    op = norm.RMS_NORM
    with pytest.raises(ValueError, match="unknown devices"):
        op.register("tpu", ("tpu",), lambda *a: None)
    with pytest.raises(ValueError, match="already has"):
        op.register("npu", ("npu",), lambda *a: None)
    with pytest.raises(ValueError, match="not op=backend"):
        registry.parse_override("attention=flash,rms_norm")
    assert registry.parse_override(" ") == {}


def test_selected_lists_every_op():

    chosen = registry.selected()
    assert {"rms_norm", "layer_norm"} <= set(chosen)


def test_env_override_reaches_real_ops(monkeypatch):
    from kernels import attention

    q, k, v = (torch.randn(1, 6, 2, 4) for _ in range(3))
    rms_norm_default = norm.RMS_NORM.default()
    monkeypatch.setenv(registry.KERNELS_ENV, "attention=blockwise")
    registry._default_backend_name.cache_clear()
    try:
        assert attention.ATTENTION.default() == "blockwise"
        assert norm.RMS_NORM.default() == rms_norm_default  # an op not named keeps its default
        torch.testing.assert_close(
            attention.attention(q, k, v), attention.attention(q, k, v, backend="reference")
        )
    finally:
        monkeypatch.delenv(registry.KERNELS_ENV)
        registry._default_backend_name.cache_clear()
    assert attention.ATTENTION.default() == attention.ATTENTION.available("cpu")[0]


def test_compiled_graphs_take_the_backend_as_a_constant():
    """torch.compile reads the chosen backend once instead of tracing the device probing (which
    imports optional vendor modules and cannot be traced): no graph break."""
    torch._dynamo.reset()
    x, weight = torch.randn(2, 3, 8), torch.rand(8) + 0.5
    # An eager call first loads the backend's module, as a model's first use would (a test
    # before this one in the same process may have dropped the loaded callables; torch 2.11's
    # dynamo cannot trace the import that reloads them).
    norm.rms_norm(x, weight)
    compiled = torch.compile(lambda t: norm.rms_norm(t, weight), fullgraph=True)
    torch.testing.assert_close(compiled(x), norm.rms_norm_reference(x, weight, 1e-6))
