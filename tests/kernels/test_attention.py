"""Attention: every CPU backend vs the fp32 reference (forward and backward, fp32/bf16/fp16),
the reference vs HF's eager attention and Bloom's ALiBi, packing, decode, lse merging, GQA,
dropout, and the block skipping of the triangle path.

Shapes: B batch, S sequence, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import eager_attention_forward

from kernels import attention as attn
from kernels.attention.blockwise import attention_blockwise
from kernels.attention.spec import build_spec
from tests.kernels.helpers import DTYPES

B, S, H, D = 2, 12, 4, 8
BACKENDS = [b for b in attn.ATTENTION.candidates("cpu") if b != "reference"]
# Attention sums S products per output: widen the elementwise tolerances accordingly.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 6e-3}


def _qkv(dtype, kv_heads=H, sq=S, sk=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, sq, H, D, generator=g).to(dtype)
    k = torch.randn(B, sk, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(B, sk, kv_heads, D, generator=g).to(dtype)
    return q, k, v


def _run(q, k, v, backend, return_lse=False, seed=1, **kw):
    """Forward + backward of sum(out·g) (+ sum(lse·g') when lse is returned)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    res = attn.attention(*leaves, backend=backend, return_lse=return_lse, **kw)
    out, lse = res if return_lse else (res, None)
    g = torch.Generator().manual_seed(seed)
    loss = (out.float() * torch.randn(out.shape, generator=g).to(out.device)).sum()
    if lse is not None:
        finite = torch.isfinite(lse)
        weights = torch.randn(lse.shape, generator=g).to(lse.device)
        loss = loss + (torch.where(finite, lse, 0) * weights).sum()
    loss.backward()
    return out.detach(), None if lse is None else lse.detach(), [t.grad for t in leaves]


def _compare(got, want, dtype, scale=1.0):
    atol = ATOL[dtype] * scale
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


def _left_padding():
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :4] = False  # second row left-padded by 4: its first queries see no key at all
    return mask


def _segments():
    return attn.segment_ids_from_cu_seqlens(torch.tensor([0, 5, 12, 15, 24]), S)


SCENARIOS = {
    "causal_mha": dict(kv_heads=H),
    "causal_gqa": dict(kv_heads=2),
    "causal_mqa": dict(kv_heads=1),
    "bidirectional_padding": dict(kv_heads=2, causal=False, key_padding_mask_BS=_left_padding()),
    "causal_left_padding": dict(kv_heads=H, key_padding_mask_BS=_left_padding()),
    "alibi_causal": dict(kv_heads=H, alibi_slopes_H=attn.alibi_slopes(H)),
    "alibi_bidirectional": dict(kv_heads=H, causal=False, alibi_slopes_H=attn.alibi_slopes(H)),
    "packed": dict(kv_heads=2, segment_ids_BS=_segments()),
    "decode_chunk": dict(kv_heads=2, sq=3),
    "decode_one": dict(kv_heads=1, sq=1),
    "custom_scale": dict(kv_heads=H, softmax_scale=0.2),
}


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference(backend, scenario, dtype, return_lse):
    kw = dict(SCENARIOS[scenario])
    q, k, v = _qkv(dtype, kv_heads=kw.pop("kv_heads"), sq=kw.pop("sq", S))
    out_ref, lse_ref, grads_ref = _run(
        q.float(), k.float(), v.float(), "reference", return_lse, **kw
    )
    out, lse, grads = _run(q, k, v, backend, return_lse, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    _compare(out, out_ref, dtype)
    if return_lse:
        assert lse.dtype == torch.float32 and lse.shape == (B, H, q.shape[1])
        torch.testing.assert_close(torch.isinf(lse), torch.isinf(lse_ref))
        _compare(lse, lse_ref, dtype)
    for got, want in zip(grads, grads_ref, strict=True):
        assert torch.isfinite(got).all()
        _compare(got, want, dtype, scale=2)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_blockwise_small_blocks_match_reference(scenario):
    kw = dict(SCENARIOS[scenario])
    q, k, v = _qkv(torch.float32, kv_heads=kw.pop("kv_heads"), sq=kw.pop("sq", S))
    kw.setdefault("causal", True)
    spec_args = dict(
        softmax_scale=None,
        alibi_slopes_H=None,
        key_padding_mask_BS=None,
        segment_ids_BS=None,
        q_offset=None,
        dropout_p=0.0,
        return_lse=True,
    )
    spec_args.update(kw)
    spec = build_spec(q, k, v, **spec_args)
    g_out, g_lse = torch.randn(q.shape), torch.randn(B, H, q.shape[1])

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        ((out * g_out).sum() + (torch.where(torch.isinf(lse), 0, lse) * g_lse).sum()).backward()
        return out.detach(), lse.detach(), [t.grad for t in leaves]

    out, lse, grads = run(lambda q, k, v: attention_blockwise(q, k, v, spec, block_q=5, block_k=3))
    out_ref, lse_ref, grads_ref = run(
        lambda q, k, v: attn.attention(q, k, v, backend="reference", **spec_args)
    )
    torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


def test_blockwise_skips_blocks_above_the_diagonal_and_across_documents():
    q, k, v = (torch.randn(1, 64, 2, 8) for _ in range(3))
    spec = build_spec(q, k, v, causal=True, softmax_scale=None, alibi_slopes_H=None,
                      key_padding_mask_BS=None, segment_ids_BS=None, q_offset=None,
                      dropout_p=0.0, return_lse=False)  # fmt: skip
    stats: dict[str, int] = {}
    out, _ = attention_blockwise(q, k, v, spec, block_q=16, block_k=16, stats=stats)
    # 4x4 blocks, causal: only the 10 on or below the diagonal are computed.
    assert stats == {"computed": 10, "skipped": 6}
    torch.testing.assert_close(
        out, attn.attention(q, k, v, backend="reference"), atol=2e-5, rtol=2e-5
    )
    seg = torch.tensor([[0] * 32 + [1] * 32])
    packed = build_spec(q, k, v, causal=True, softmax_scale=None, alibi_slopes_H=None,
                        key_padding_mask_BS=None, segment_ids_BS=seg, q_offset=None,
                        dropout_p=0.0, return_lse=False)  # fmt: skip
    stats = {}
    attention_blockwise(q, k, v, packed, block_q=16, block_k=16, stats=stats)
    # Two documents of two blocks each: 3 causal blocks per document.
    assert stats == {"computed": 6, "skipped": 10}


def test_reference_matches_hf_eager_attention_gqa():
    q, k, v = _qkv(torch.float32, kv_heads=2)
    module = nn.Module()
    module.num_key_value_groups = H // 2
    module.eval()
    causal_mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    hf_out, _ = eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal_mask, D**-0.5
    )
    for backend in ["reference", *BACKENDS]:
        torch.testing.assert_close(
            attn.attention(q, k, v, backend=backend), hf_out, atol=2e-5, rtol=2e-5
        )


@pytest.mark.parametrize("heads", [8, 12, 16, 6])
def test_alibi_slopes_match_bloom(heads):
    mask = torch.ones(1, 5)
    hf = build_alibi_tensor(mask, heads, torch.float32)  # [H, 1, S] = slope_h * position
    torch.testing.assert_close(attn.alibi_slopes(heads), hf[:, 0, 1])


def test_alibi_attention_matches_bloom_absolute_bias():
    # Bloom adds slope·j; ours adds slope·(j - i): a per-row shift, so outputs are identical.
    q, k, v = _qkv(torch.float32)
    slopes = attn.alibi_slopes(H)
    alibi = build_alibi_tensor(torch.ones(B, S), H, torch.float32).view(B, H, 1, S)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5 + alibi
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    for backend in ["reference", *BACKENDS]:
        got = attn.attention(q, k, v, alibi_slopes_H=slopes, backend=backend)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_packed_equals_documents_separately(backend):
    lengths = [5, 4, 3]
    q, k, v = (torch.randn(1, S, H, D) for _ in range(3))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seg = attn.segment_ids_from_position_ids(pos)
    packed = attn.attention(q, k, v, segment_ids_BS=seg, backend=backend)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = attn.attention(q[:, sl], k[:, sl], v[:, sl], backend=backend)
        torch.testing.assert_close(packed[:, sl], alone, atol=2e-5, rtol=2e-5)
        start += n


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_kv_cache_decode_equals_last_row_of_full(backend):
    q, k, v = _qkv(torch.float32, kv_heads=2)
    full = attn.attention(q, k, v, backend=backend)
    step = attn.attention(q[:, -1:], k, v, backend=backend)
    assert step.shape == (B, 1, H, D)
    torch.testing.assert_close(step, full[:, -1:], atol=2e-5, rtol=2e-5)
    chunk = attn.attention(q[:, -4:], k, v, backend=backend)
    torch.testing.assert_close(chunk, full[:, -4:], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_lse_merge_of_two_key_halves_equals_full_forward_and_backward(backend, causal):
    q, k, v = _qkv(torch.float32, kv_heads=2, seed=4)
    half = S // 2

    def merged(q, k, v):
        out1, lse1 = attn.attention(q, k[:, :half], v[:, :half], causal=causal, q_offset=0,
                                    return_lse=True, backend=backend)  # fmt: skip
        # The second half starts `half` keys later: query i sees key j' iff j' <= i - half.
        out2, lse2 = attn.attention(q, k[:, half:], v[:, half:], causal=causal, q_offset=-half,
                                    return_lse=True, backend=backend)  # fmt: skip
        lse = torch.logaddexp(lse1, lse2)
        w1 = torch.exp(lse1 - lse).transpose(1, 2)[..., None]
        w2 = torch.exp(lse2 - lse).transpose(1, 2)[..., None]
        return out1 * w1 + out2 * w2, lse

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = merged(*leaves)
    g = torch.randn(out.shape)
    ((out * g).sum() + lse.sum()).backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = attn.attention(
        *ref_leaves, causal=causal, return_lse=True, backend="reference"
    )
    ((out_ref * g).sum() + lse_ref.sum()).backward()
    torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5)
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_gqa_equals_mha_with_repeated_kv(backend):
    q, k, v = _qkv(torch.float32, kv_heads=2)
    gqa = attn.attention(q, k, v, backend=backend)
    mha = attn.attention(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), backend=backend)
    torch.testing.assert_close(gqa, mha, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_dropout_statistics_and_seed_determinism(backend):
    p, sk = 0.3, 32
    # Uniform attention (q = 0) over one-hot values: output entry j is p_j·keep_j/(1-p).
    q = torch.zeros(4, 16, 2, sk)
    k = torch.randn(4, sk, 2, sk)
    v = torch.eye(sk).expand(4, 2, sk, sk).transpose(1, 2).contiguous()
    torch.manual_seed(7)
    a = attn.attention(q, k, v, causal=False, dropout_p=p, backend=backend)
    torch.manual_seed(7)
    b = attn.attention(q, k, v, causal=False, dropout_p=p, backend=backend)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    dropped = (a == 0).float().mean().item()
    assert abs(dropped - p) < 0.03, dropped
    torch.testing.assert_close(a[a != 0], torch.full_like(a[a != 0], 1 / (sk * (1 - p))))
    torch.manual_seed(8)
    c = attn.attention(q, k, v, causal=False, dropout_p=p, backend=backend)
    assert not torch.equal(a, c)


def test_queries_seeing_no_key_give_zero_and_minus_inf_lse():
    q, k, v = _qkv(torch.float32)
    for backend in ["reference", *BACKENDS]:
        out, lse, grads = _run(q, k, v, backend, True, key_padding_mask_BS=_left_padding())
        assert torch.equal(out[1, :4], torch.zeros_like(out[1, :4]))
        assert torch.isneginf(lse[1, :, :4]).all() and torch.isfinite(lse[0]).all()
        assert all(torch.isfinite(g).all() for g in grads)


def test_segment_id_helpers():
    seg = attn.segment_ids_from_cu_seqlens(torch.tensor([0, 3, 7, 10]), 6)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 1], [1, 2, 2, 2, 3, 3]]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    assert attn.segment_ids_from_position_ids(pos).tolist() == [
        [1, 1, 1, 2, 2, 3],
        [0, 0, 1, 1, 1, 1],
    ]
    with pytest.raises(ValueError, match="never decrease"):
        attn.segment_ids_from_cu_seqlens(torch.tensor([0, 5, 3]), 4)


def test_bad_inputs_raise_clear_errors():
    q, k, v = _qkv(torch.float32, kv_heads=3)
    with pytest.raises(ValueError, match="multiple of 3 kv heads"):
        attn.attention(q, k, v)
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match="key_padding_mask_BS must be bool"):
        attn.attention(q, k, v, key_padding_mask_BS=torch.ones(B, S))
    with pytest.raises(ValueError, match="segment_ids_BS needs equal"):
        attn.attention(q[:, :3], k, v, segment_ids_BS=torch.zeros(B, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="dropout_p"):
        attn.attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="cannot run this call"):
        attn.attention(q, k, v, dropout_p=0.1, return_lse=True, backend="sdpa")
    with pytest.raises(ValueError, match="no backend 'magic'"):
        attn.attention(q, k, v, backend="magic")


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("backend", ["flash", "sdpa", "blockwise"])
def test_cuda_backends_match_reference(backend, scenario):
    if backend == "flash":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    _device_backend_vs_reference(backend, scenario)


@pytest.mark.npu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("backend", ["npu", "blockwise"])
def test_npu_backends_match_reference(backend, scenario):
    _device_backend_vs_reference(backend, scenario)


def _device_backend_vs_reference(backend, scenario):
    from kernels import device

    dev = device.current().torch_device()
    kw = {
        key: (val.to(dev) if isinstance(val, torch.Tensor) else val)
        for key, val in SCENARIOS[scenario].items()
    }
    q, k, v = (
        t.to(dev) for t in _qkv(torch.bfloat16, kv_heads=kw.pop("kv_heads"), sq=kw.pop("sq", S))
    )
    try:
        out, _, grads = _run(q, k, v, backend, **kw)
    except ValueError as exc:
        pytest.skip(f"{backend} declines {scenario}: {exc}")
    out_ref, _, grads_ref = _run(q.float(), k.float(), v.float(), "reference", **kw)
    _compare(out.cpu(), out_ref.cpu(), torch.bfloat16)
    for got, want in zip(grads, grads_ref, strict=True):
        _compare(got.cpu(), want.cpu(), torch.bfloat16, scale=2)


def _saved_bytes(fn, *inputs):
    """Bytes autograd saves for backward while running fn (inputs themselves excluded)."""
    ids = {id(x) for x in inputs}
    total = 0

    def pack(t):
        nonlocal total
        if id(t) not in ids:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return total


def test_blockwise_backward_saves_linear_not_quadratic_memory():
    s, h, d = 256, 2, 16
    q, k, v = (torch.randn(1, s, h, d, requires_grad=True) for _ in range(3))
    blockwise = _saved_bytes(lambda q, k, v: attn.attention(q, k, v, backend="blockwise"), q, k, v)
    reference = _saved_bytes(lambda q, k, v: attn.attention(q, k, v, backend="reference"), q, k, v)
    scores_bytes = h * s * s * 4
    # Output (fp32) and lse only: O(S·H·D), far below one [H, S, S] score matrix.
    assert blockwise <= h * s * (d + 1) * 4 + 1024
    assert reference >= scores_bytes


@pytest.mark.parametrize("masked", [False, True])
def test_single_query_gqa_folds_query_groups_and_matches_reference(monkeypatch, masked):
    """One query per row with grouped kv heads (decode): the sdpa backend runs the G query
    heads of each kv head as one sequence of G queries (no repeated keys), with the reference's
    result, under a per-row key mask too; a per-head bias (ALiBi) keeps the plain call."""
    from kernels.attention import sdpa

    calls = []
    original = sdpa.grouped_single_query
    monkeypatch.setattr(sdpa, "grouped_single_query", lambda *a: calls.append(1) or original(*a))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 8, 16, generator=gen)
    k = torch.randn(3, 9, 2, 16, generator=gen)
    v = torch.randn(3, 9, 2, 16, generator=gen)
    mask = torch.rand(3, 9, generator=gen) > 0.3 if masked else None
    if mask is not None:
        mask[:, -1] = True
    kw = dict(causal=True, q_offset=8, key_padding_mask_BS=mask)
    got = attn.attention(q, k, v, backend="sdpa", **kw)
    want = attn.attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1]
    slopes = torch.rand(8, generator=gen)
    attn.attention(q, k, v, backend="sdpa", alibi_slopes_H=slopes, **kw)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_differentiated_in_low_precision_on_cpu_runs_in_fp32(dtype):
    """CPU bf16/fp16 attention with gradients runs the fp32 kernel (its backward is 2-2.5x faster
    than the low-precision one) and casts back; without gradients the low-precision kernel runs."""
    import torch.nn.functional as F

    q, k, v = _qkv(dtype, kv_heads=2)
    kw = dict(causal=True, backend="sdpa")

    def sdpa(qq, kk, vv):
        return F.scaled_dot_product_attention(
            qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), is_causal=True,
            enable_gqa=True,
        ).transpose(1, 2)  # fmt: skip

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attn.attention(*leaves, **kw)
    assert out.dtype == dtype
    assert torch.equal(out, sdpa(q.float(), k.float(), v.float()).to(dtype))
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in leaves)
    with torch.no_grad():
        assert torch.equal(attn.attention(q, k, v, **kw), sdpa(q, k, v))
    # the lse path (context-parallel blocks) computes the same way
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attn.attention(*leaves, return_lse=True, **kw)
    want, want_lse = attn.attention(q.float(), k.float(), v.float(), return_lse=True, **kw)
    assert out.dtype == dtype and torch.equal(out, want.to(dtype)) and torch.equal(lse, want_lse)
    (out.float().sum() + lse.sum()).backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in leaves)
