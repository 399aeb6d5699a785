"""The fused fp32 CPU training kernels (kernels/cpu/train_ops.c) against their references.

Tolerances: RoPE and RMSNorm's forward are bit-identical (same formulas, same order, torch's own
reduction for RMSNorm's rstd); RMSNorm's backward, SwiGLU and the cross entropy take sums in
another order or a polynomial exp, so they match to fp32 rounding: rtol 1e-5 on values of order
one, and 1e-4 on a weight gradient summed over every row; attention sums S products per output
and takes test_attention's fp32 tolerance against the dense reference. Which calls take the kernels (training
only) is part of the contract: inference and evaluation must keep the references' bits.
"""

from __future__ import annotations

import importlib
import platform
import shutil

import pytest
import torch

from kernels import activation, attention, cross_entropy, norm, registry, rotary
from kernels.rotary import RotaryEmbedding

try:
    fused = importlib.import_module("kernels.cpu.fused")
except ImportError:  # not built here (the test below says whether it should have been)
    fused = None
needs_build = pytest.mark.skipif(fused is None, reason="kernels.cpu.train_ops is not built")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _grads(fn, inputs, grad_outs):
    leaves = [_leaf(x) for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grad_outs)
    return [o.detach() for o in outs], [x.grad for x in leaves]


def test_the_kernels_are_built_where_a_compiler_exists():
    """setuptools builds train_ops.c as an optional extension: on x86-64 with a C compiler (CI,
    the dev machine) a silent build failure would only show as slower training."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None:
        pytest.skip("checked where a C compiler exists on x86-64")
    assert fused is not None
    ops = (
        norm.RMS_NORM,
        activation.SWIGLU_PACKED,
        rotary.ROTARY_QKV,
        cross_entropy.PER_TOKEN,
        attention.ATTENTION,
    )
    for op in ops:
        assert op.default() == "fused", op.name


@needs_build
@pytest.mark.parametrize("e", [256, 37])
def test_rms_norm_forward_is_bit_identical_and_backward_matches(e):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, e, generator=g) * 3 + 0.5
    w = 1 + 0.1 * torch.randn(e, generator=g)
    dy = torch.randn(3, 50, e, generator=g)
    (out,), (dx, dw) = _grads(lambda x, w: fused.rms_norm(x, w, 1e-6), [x, w], [dy])
    (ref,), (ref_dx, ref_dw) = _grads(
        lambda x, w: norm.rms_norm_reference(x, w, 1e-6), [x, w], [dy]
    )
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(dx, ref_dx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, ref_dw, atol=1e-4, rtol=1e-4)


@needs_build
@pytest.mark.parametrize("f", [704, 13])
def test_swiglu_packed_matches_reference(f):
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(2, 40, 2 * f, generator=g) * 4
    gate_up[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    dy = torch.randn(2, 40, f, generator=g)
    (out,), (dgu,) = _grads(fused.swiglu_packed, [gate_up], [dy])
    (ref,), (ref_dgu,) = _grads(activation.swiglu_packed_reference, [gate_up], [dy])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dgu, ref_dgu, atol=1e-5, rtol=1e-5)


@needs_build
@pytest.mark.parametrize("cos_batch", [3, 1])
@pytest.mark.parametrize("only", [None, 0, 2])
def test_rotary_qkv_is_bit_identical(cos_batch, only):
    """Forward and backward equal the eager split + apply_rotary bit for bit, also when only one
    of q, k, v receives a gradient (the others' parts of d qkv are zero)."""
    b, s, h, k, d = 3, 20, 8, 4, 32
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(b, s, h + 2 * k, d, generator=g)
    positions = torch.arange(s).expand(cos_batch, s) + torch.arange(cos_batch)[:, None]
    cos, sin = RotaryEmbedding(d)(positions)
    grads = [torch.randn(b, s, n, d, generator=g) for n in (h, k, k)]
    if only is not None:
        grads = [gr if i == only else torch.zeros_like(gr) for i, gr in enumerate(grads)]

    def run(fn):
        leaf = _leaf(qkv)
        outs = fn(leaf, cos, sin, h, k)
        if only is None:
            torch.autograd.backward(outs, grads)
        else:
            outs[only].backward(grads[only])
        return [o.detach() for o in outs], leaf.grad

    outs, dqkv = run(fused.rotary_qkv)
    refs, ref_dqkv = run(rotary.rotary_qkv_reference)
    for got, want in zip(outs, refs, strict=True):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(dqkv, ref_dqkv, atol=0, rtol=0)


@needs_build
@pytest.mark.parametrize("vocab", [4096, 1001])
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_cross_entropy_matches_chunked(vocab, z_loss):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(300, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (300,), generator=g)
    labels[::7] = -100
    valid = labels != -100
    weight = torch.rand(300, generator=g)
    (loss,), (grad,) = _grads(
        lambda x: fused.per_token(x, labels, valid, z_loss), [logits], [weight]
    )
    (ref,), (ref_grad,) = _grads(
        lambda x: cross_entropy.per_token_chunked(x, labels, valid, z_loss), [logits], [weight]
    )
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    assert not loss[~valid].any() and not grad[~valid].any()


@needs_build
def test_cross_entropy_keeps_nan_visible():
    """A NaN logit must give a NaN loss (the trainer stops or skips on it), not a clamped one."""
    logits = torch.randn(4, 64, requires_grad=True)
    with torch.no_grad():
        logits[1, 5] = float("nan")
    labels = torch.tensor([1, 2, 3, 4])
    loss = fused.per_token(logits, labels, labels >= 0, 0.0)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()


@needs_build
def test_out_of_vocabulary_label_is_refused_by_the_kernel():
    logits = torch.randn(2, 8, requires_grad=True)
    labels = torch.tensor([1, 8])
    with pytest.raises(ValueError, match="label 8 at row 1 is outside the vocabulary"):
        fused.per_token(logits, labels, torch.ones(2, dtype=torch.bool), 0.0)


@needs_build
def test_calls_outside_training_run_the_references(monkeypatch):
    """No grad, bf16 or non-contiguous input: the reference runs (inference keeps its bits)."""
    calls = []
    for name in ("_RMSNorm", "_SwiGLU", "_RotaryQKV", "_CrossEntropy", "_Attention"):
        cls = getattr(fused, name)
        monkeypatch.setattr(cls, "apply", lambda *a, _n=name: calls.append(_n))
    x = torch.randn(2, 5, 16)
    w = torch.ones(16, requires_grad=True)
    cos, sin = RotaryEmbedding(8)(torch.arange(5)[None])
    qkv = torch.randn(2, 5, 4, 8, requires_grad=True)
    labels = torch.tensor([1, 2])
    q, k, v = (torch.randn(2, 5, 2, 16, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        fused.rms_norm(x, w, 1e-6)
        fused.swiglu_packed(x.requires_grad_())
        fused.rotary_qkv(qkv, cos, sin, 2, 1)
        fused.per_token(x[0, :2], labels, labels >= 0, 0.0)
        attention.attention(q, k, v, backend="fused")
    fused.rms_norm(x.detach(), w.detach(), 1e-6)  # nothing requires grad
    fused.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    fused.swiglu_packed(torch.randn(2, 16, 5, requires_grad=True).transpose(1, 2))
    assert calls == []
    fused.rms_norm(x, w, 1e-6)
    fused.swiglu_packed(x)
    fused.rotary_qkv(qkv, cos, sin, 2, 1)
    fused.per_token(torch.randn(2, 16, requires_grad=True), labels, labels >= 0, 0.0)
    attention.attention(q, k, v, backend="fused")
    assert calls == ["_RMSNorm", "_SwiGLU", "_RotaryQKV", "_CrossEntropy", "_Attention"]


@needs_build
def test_training_step_of_the_model_matches_the_references(monkeypatch):
    """A Llama training step (loss and every parameter gradient) with the fused kernels equals
    the same step with the five ops on their previous defaults, to fp32 rounding."""
    from models import build_model
    from models.registry import get_config

    config = get_config(
        "tiny-llama-gqa", vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_kv_heads=2, ffn_hidden_size=88, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    ids = torch.randint(0, 96, (2, 24))
    labels = torch.randint(0, 96, (2, 24))
    ran = []
    for name in ("_RMSNorm", "_SwiGLU", "_RotaryQKV", "_CrossEntropy", "_Attention"):
        cls = getattr(fused, name)
        monkeypatch.setattr(
            cls, "apply", lambda *a, _n=name, _f=cls.apply: (ran.append(_n), _f(*a))[1]
        )

    def step():
        model.zero_grad(set_to_none=True)
        loss = cross_entropy.cross_entropy(model(ids), labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = step()
    assert set(ran) == {"_RMSNorm", "_SwiGLU", "_RotaryQKV", "_CrossEntropy", "_Attention"}
    monkeypatch.setenv(
        registry.KERNELS_ENV,
        "rms_norm=reference,swiglu_packed=reference,rotary_qkv=reference,cross_entropy=chunked,"
        "attention=sdpa",
    )
    registry._default_backend_name.cache_clear()
    try:
        ref_loss, ref_grads = step()
    finally:
        monkeypatch.delenv(registry.KERNELS_ENV)
        registry._default_backend_name.cache_clear()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def _attention_grads(backend, shape, seed=0):
    b, s, h, k, d = shape
    g = torch.Generator().manual_seed(seed)
    q, kk, v = (torch.randn(b, s, n, d, generator=g) for n in (h, k, k))
    dout = torch.randn(b, s, h, d, generator=g)
    return _grads(lambda *t: attention.attention(*t, backend=backend), [q, kk, v], [dout])


@needs_build
@pytest.mark.parametrize(
    "shape",
    [(4, 64, 8, 4, 32), (2, 37, 4, 1, 16), (1, 50, 2, 2, 128), (2, 1, 3, 1, 48), (1, 19, 6, 3, 64)],
    ids=["gqa", "mqa-ragged", "mha-d128", "one-token", "gqa-d64"],
)
def test_attention_matches_reference_forward_and_backward(shape):
    """Causal attention (GQA/MQA/MHA, lengths that are not multiples of the 4 x 16 tile) against
    the dense fp32 reference, and as close to it as torch's sdpa is: each output sums S
    products, so the tolerance is test_attention's fp32 one."""
    assert fused is not None
    ran = []
    original = fused._Attention.apply
    fused._Attention.apply = lambda *a: (ran.append(1), original(*a))[1]
    try:
        (out,), grads = _attention_grads("fused", shape)
    finally:
        fused._Attention.apply = original
    assert ran, "the C kernel did not take the call"
    (ref,), ref_grads = _attention_grads("reference", shape)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_build
def test_attention_results_do_not_depend_on_the_thread_count():
    """Each (batch, head) is one task: one or two threads give the same bits."""
    shape = (2, 40, 4, 2, 32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attention_grads("fused", shape)
        torch.set_num_threads(2)
        two = _attention_grads("fused", shape)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one[0] + one[1], two[0] + two[1], strict=True):
        assert torch.equal(a, b)


@needs_build
@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=False),
        dict(key_padding_mask_BS=torch.ones(2, 12, dtype=torch.bool)),
        dict(window=4),
        dict(return_lse=True),
        dict(head_dim=8),
        dict(q_len=3),
    ],
    ids=["bidirectional", "padding", "window", "lse", "head-dim-8", "decode-chunk"],
)
def test_attention_calls_it_does_not_take_run_sdpa_bit_for_bit(kw):
    kw = dict(kw)
    d, sq = kw.pop("head_dim", 16), kw.pop("q_len", 12)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, sq, 4, d, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 12, 2, d, generator=g, requires_grad=True) for _ in range(2))
    got = attention.attention(q, k, v, backend="fused", **kw)
    want = attention.attention(q, k, v, backend="sdpa", **kw)
    if not isinstance(got, tuple):
        got, want = (got,), (want,)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@needs_build
def test_attention_over_its_scratch_budget_runs_sdpa(monkeypatch):
    """The backward's [S, S] tables per working thread are bounded: over the budget, sdpa runs."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 40, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    # 48 x 48 padded, two tables, fp32, one thread per (batch, kv head) up to the thread count
    needed = min(torch.get_num_threads(), 4) * 2 * 48 * 48 * 4
    assert fused._attention_scratch_bytes(2, 2, 40) == needed
    monkeypatch.setattr(fused, "ATTENTION_MAX_SCRATCH", needed - 1)
    monkeypatch.setattr(fused._Attention, "apply", lambda *a: pytest.fail("the C kernel ran"))
    got = attention.attention(q, k, v, backend="fused")
    assert torch.equal(got, attention.attention(q, k, v, backend="sdpa"))
