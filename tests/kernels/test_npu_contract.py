"""Meshline's torch_npu calls against the contract of the torch_npu wheel paired with torch.

Two checks that need no Ascend device: every `torch_npu.*` call in product code binds to the
op's documented prototype (names, positions, literal layouts); and the NPU backends, run on CPU
against a stand-in module that implements the documented signatures with the documented math,
match the plain-PyTorch references forward and backward.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kernels import registry
from kernels.activation import swiglu_packed_reference
from kernels.attention import attention
from kernels.norm import rms_norm_reference
from kernels.rotary import apply_rotary_reference
from tests.kernels import npu_contract
from tests.kernels.npu_standin import StandIn

ROOT = npu_contract.reference_root()
if ROOT is None:
    if os.environ.get("CI"):
        raise RuntimeError(
            "the torch_npu reference wheel is missing under .venv/torch_npu-reference: "
            "`make setup` installs it (TORCH_NPU_SPEC in the Makefile)"
        )
    pytest.skip(
        "torch_npu reference wheel not installed (run `make setup`, or set "
        f"{npu_contract.DOCS_ENV} to a directory holding torch_npu/)",
        allow_module_level=True,
    )
assert ROOT is not None
NPU_MODULES = (
    "kernels.npu.attention",
    "kernels.npu.norm",
    "kernels.npu.rotary",
    "kernels.npu.activation",
    "kernels.npu.optim",
)
# Arguments Meshline's optimizer registry passes to kernels.npu.optim.fused_adamw.
FUSED_ADAMW_KWARGS = ("lr", "weight_decay", "betas", "eps")


def test_prototype_parser_reads_the_documented_ops() -> None:
    ops = npu_contract.documented_ops(ROOT)
    for name in ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"):
        assert name in ops, f"{name} is not documented in the installed torch_npu"
    (attention_proto,) = ops["npu_fusion_attention"]
    params = list(attention_proto.signature.parameters)
    assert params[:5] == ["query", "key", "value", "head_num", "input_layout"]
    assert attention_proto.signature.parameters["sparse_mode"].default == 0
    assert attention_proto.types["pse"] == "Tensor?"


def test_every_product_call_binds_to_the_documented_prototype() -> None:
    calls = npu_contract.product_calls()
    ops = npu_contract.documented_ops(ROOT)
    called = {call.path for call in calls}
    assert {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= called
    assert "optim.NpuFusedAdamW" in called
    adamw = npu_contract.optimizer_signature(ROOT, "npu_fused_adamw", "NpuFusedAdamW")
    layouts = ("BSH", "SBH", "BSND", "BNSD", "TND")
    for call in calls:
        where = f"{call.file}:{call.line} torch_npu.{call.path}"
        if call.path == "optim.NpuFusedAdamW":
            adamw.bind(object(), **dict.fromkeys(FUSED_ADAMW_KWARGS))
            continue
        assert call.path in ops, f"{where}: no such op in torch_npu's docs"
        assert not call.has_star_kwargs, f"{where}: pass documented keywords explicitly"
        bindable = []
        for proto in ops[call.path]:
            try:
                proto.signature.bind(*[object()] * call.positional, **dict.fromkeys(call.keywords))
            except TypeError as exc:
                bindable.append(str(exc))
                continue
            bindable = []
            layout = call.literals.get("input_layout", call.literals.get("#4"))
            if call.path == "npu_fusion_attention":
                assert layout in layouts, f"{where}: input_layout {layout!r} not documented"
            break
        assert not bindable, f"{where} does not bind: {bindable}"


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    """The stand-in installed as torch_npu, with the NPU backend modules imported fresh."""
    module = StandIn(ROOT)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    for name in NPU_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    registry.forget_loaded()
    yield module
    for name in NPU_MODULES:
        sys.modules.pop(name, None)
    registry.forget_loaded()


def _leaf(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()


def _grads(out: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor]:
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    return list(torch.autograd.grad(out.float(), leaves, upstream))


def test_rms_norm_backend_matches_reference(standin: StandIn) -> None:
    npu_norm = importlib.import_module("kernels.npu.norm")
    x, w = _leaf(2, 5, 32), _leaf(32, seed=1)
    out = npu_norm.rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(out, x, w), _grads(ref, x, w), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert standin.calls[-1][1]["epsilon"] == 1e-6


def test_rotary_backend_matches_reference(standin: StandIn) -> None:
    npu_rotary = importlib.import_module("kernels.npu.rotary")
    x = _leaf(2, 7, 4, 16)
    angles = torch.randn(2, 7, 16)
    cos, sin = angles.cos(), angles.sin()
    out = npu_rotary.apply_rotary(x, cos, sin)
    ref = apply_rotary_reference(x, cos, sin)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_grads(out, x)[0], _grads(ref, x)[0], rtol=1e-5, atol=1e-5)
    assert standin.calls[-1][0] == "npu_rotary_mul"


def test_swiglu_backend_matches_reference(standin: StandIn) -> None:
    npu_activation = importlib.import_module("kernels.npu.activation")
    gate_up = _leaf(3, 5, 64)
    out = npu_activation.swiglu_packed(gate_up)
    ref = swiglu_packed_reference(gate_up)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(_grads(out, gate_up)[0], _grads(ref, gate_up)[0])
    assert standin.calls[-1][1]["dim"] == -1


ATTENTION_CASES: dict[str, dict[str, Any]] = {
    "causal-gqa": {"q_len": 9, "k_len": 9, "heads": 4, "kv_heads": 2},
    "causal-cached-suffix": {"q_len": 3, "k_len": 11, "heads": 4, "kv_heads": 4},
    "alibi-causal": {"q_len": 8, "k_len": 8, "heads": 4, "kv_heads": 4, "alibi": True},
    "packed-documents": {"q_len": 10, "k_len": 10, "heads": 2, "kv_heads": 1, "segments": True},
    "bidirectional": {"q_len": 6, "k_len": 6, "heads": 2, "kv_heads": 2, "causal": False},
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_backend_matches_reference(standin: StandIn, case: str) -> None:
    params = ATTENTION_CASES[case]
    q = _leaf(2, params["q_len"], params["heads"], 16, dtype=torch.bfloat16)
    k = _leaf(2, params["k_len"], params["kv_heads"], 16, dtype=torch.bfloat16, seed=1)
    v = _leaf(2, params["k_len"], params["kv_heads"], 16, dtype=torch.bfloat16, seed=2)
    kwargs: dict[str, Any] = {"causal": params.get("causal", True)}
    if params.get("alibi"):
        kwargs["alibi_slopes_H"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    if params.get("segments"):
        kwargs["segment_ids_BS"] = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    out = attention(q, k, v, backend="npu", **kwargs)
    ref = attention(q, k, v, backend="reference", **kwargs)
    assert isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
    # bf16 outputs: one rounding of values of order 1.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for got, want in zip(_grads(out, q, k, v), _grads(ref, q, k, v), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    name, bound = standin.calls[-1]
    assert name == "npu_fusion_attention" and bound["input_layout"] == "BSND"
    plain_causal = kwargs["causal"] and not params.get("segments")
    assert bound["sparse_mode"] == (3 if plain_causal else 0)


def test_attention_lse_matches_reference(standin: StandIn) -> None:
    q = _leaf(1, 5, 2, 8, dtype=torch.float16).detach()
    k = _leaf(1, 5, 2, 8, dtype=torch.float16, seed=1).detach()
    v = _leaf(1, 5, 2, 8, dtype=torch.float16, seed=2).detach()
    with torch.no_grad():
        out, lse = attention(q, k, v, backend="npu", return_lse=True)
        ref_out, ref_lse = attention(q, k, v, backend="reference", return_lse=True)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_fused_adamw_takes_the_registry_arguments(standin: StandIn) -> None:
    npu_optim = importlib.import_module("kernels.npu.optim")
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = npu_optim.fused_adamw(
        [weight], lr=0.1, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8
    )
    weight.grad = torch.ones(4)
    optimizer.step()
    assert standin.calls[-1][0] == "optim.NpuFusedAdamW"
    assert standin.calls[-1][1]["betas"] == (0.9, 0.95)
    assert torch.all(weight < 1)
