"""Sliding-window attention (Mistral): every CPU backend equals a brute-force masked softmax, in
prefill, in cached decode (q_offset) and with padding, forward and backward (fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention import attention

BACKENDS = ["reference", "sdpa", "blockwise"]


def _brute(q, k, v, window, q_offset, padding=None):
    """Key j visible to query i iff i + q_offset - window < j <= i + q_offset (and j real)."""
    b, sq, h, d = q.shape
    sk, kv = k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(h // kv, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    i = torch.arange(sq)[:, None] + q_offset
    j = torch.arange(sk)[None, :]
    visible = (j <= i) & (j > i - window)
    mask = visible[None, None].expand(b, 1, sq, sk)
    if padding is not None:
        mask = mask & padding[:, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "sq,sk,window", [(24, 24, 5), (24, 24, 1), (3, 30, 7), (1, 30, 4), (300, 300, 70)]
)
def test_window_matches_brute_force(backend, sq, sk, window):
    gen = torch.Generator().manual_seed(sq * 100 + sk + window)
    q = torch.randn(2, sq, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, sk, 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, sk, 2, 16, generator=gen, requires_grad=True)
    out = attention(q, k, v, causal=True, window=window, backend=backend)
    expected = _brute(q, k, v, window, sk - sq)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_with_key_padding(backend):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 12, 2, 8, generator=gen) for _ in range(3))
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :4] = False  # left padding of row 1
    out = attention(q, k, v, causal=True, window=3, key_padding_mask_BS=padding, backend=backend)
    expected = _brute(q, k, v, 3, 0, padding)
    real = padding[:, :, None, None].expand_as(out)
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)


def test_window_needs_causal_and_a_positive_size():
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, causal=False, window=2)
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, causal=True, window=0)
