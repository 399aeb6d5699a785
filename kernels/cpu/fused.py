"""Fused fp32 CPU training kernels (train_ops.c) as autograd functions: the CPU backends of
rms_norm, swiglu_packed, rotary_qkv, the per-token cross entropy and causal attention.

Shapes: N rows (tokens), E hidden, F ffn, B batch, S sequence, H heads, K kv heads, D head dim,
X = H + 2K fused q|k|v heads, V vocab.

Each backend runs its C kernel only when autograd records the call (grad mode on, an input
that requires grad), on contiguous fp32 CPU tensors and outside torch.compile tracing; every
other call (inference, evaluation, bf16/fp16, compiled graphs) runs the op's reference, so
those paths keep torch's results bit for bit. What the kernels change is a training step's
elementwise work: one pass per op and direction instead of 5-15 eager ops, and the gradients
of the fused q|k|v and gate|up projections written into one buffer instead of concatenated by
autograd (bench/RESULTS.md, "Fused CPU training kernels"). Tolerances against the references
are in tests/kernels/test_cpu_fused.py.

The module raises ImportError where the extension was not built or the CPU lacks AVX2/FMA;
kernels.registry then keeps the reference as the CPU default.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from kernels.activation import swiglu_packed_reference
from kernels.attention.sdpa import attention_sdpa
from kernels.attention.spec import AttentionSpec
from kernels.cross_entropy import per_token_chunked
from kernels.norm import rms_norm_reference
from kernels.rotary import rotary_qkv_reference

try:  # built at install where a compiler is present (train_ops.c)
    import kernels.cpu.train_ops as _ops
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError(
        "kernels.cpu.train_ops is not built (no C compiler at install, or not x86-64): "
        "the eager reference ops run instead"
    ) from err
if not _ops.simd():  # pragma: no cover - depends on the CPU
    raise ImportError("this CPU lacks AVX2/FMA, which kernels.cpu.train_ops needs")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels take this call: autograd records it, every tensor is a plain
    contiguous fp32 CPU tensor (not a DTensor or another subclass, whose data pointer is not
    its data), and torch.compile is not tracing (it fuses the reference itself)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if not any(t.requires_grad for t in tensors):
        return False
    return all(
        type(t) in _PLAIN
        and t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.is_contiguous()
        for t in tensors
    )


def _threads() -> int:
    return torch.get_num_threads()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        e = x.shape[-1]
        # torch's own reduction, as HF's LlamaRMSNorm: the forward stays bit-identical to it.
        rstd_N = torch.rsqrt(x.pow(2).mean(-1) + eps).reshape(-1)
        out = torch.empty_like(x)
        _ops.rms_norm_fwd(
            x.data_ptr(), weight.data_ptr(), rstd_N.data_ptr(), out.data_ptr(), x.numel() // e, e,
            _threads(),
        )  # fmt: skip
        ctx.save_for_backward(x, weight, rstd_N)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd_N = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        dw = torch.empty_like(weight)
        e = x.shape[-1]
        _ops.rms_norm_bwd(
            x.data_ptr(), weight.data_ptr(), rstd_N.data_ptr(), dy.data_ptr(), dx.data_ptr(),
            dw.data_ptr(), x.numel() // e, e, _threads(),
        )  # fmt: skip
        return dx, dw if ctx.needs_input_grad[1] else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.norm.rms_norm's CPU backend (fused forward and backward while training)."""
    if x.numel() and applies(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        f = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], f))
        _ops.swiglu_fwd(
            gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * f), f, _threads()
        )
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        dout = dout.contiguous()
        dgate_up = torch.empty_like(gate_up)
        f = gate_up.shape[-1] // 2
        _ops.swiglu_bwd(
            gate_up.data_ptr(), dout.data_ptr(), dgate_up.data_ptr(), gate_up.numel() // (2 * f),
            f, _threads(),
        )  # fmt: skip
        return dgate_up


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """kernels.activation.swiglu_packed's CPU backend: silu(gate) * up over [..., 2F]."""
    if gate_up.shape[-1] % 2 == 0 and gate_up.numel() and applies(gate_up):
        return _SwiGLU.apply(gate_up)
    return swiglu_packed_reference(gate_up)


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv_BSXD, cos_BSD, sin_BSD, heads, kv_heads):
        b, s, _, d = qkv_BSXD.shape
        q_BSHD = qkv_BSXD.new_empty((b, s, heads, d))
        k_BSKD = qkv_BSXD.new_empty((b, s, kv_heads, d))
        v_BSKD = qkv_BSXD.new_empty((b, s, kv_heads, d))
        per_batch = cos_BSD.shape[0] != 1
        _ops.rope_qkv_fwd(
            qkv_BSXD.data_ptr(), cos_BSD.data_ptr(), sin_BSD.data_ptr(), q_BSHD.data_ptr(),
            k_BSKD.data_ptr(), v_BSKD.data_ptr(), b, s, heads, kv_heads, d, per_batch, _threads(),
        )  # fmt: skip
        ctx.save_for_backward(cos_BSD, sin_BSD)
        ctx.set_materialize_grads(False)  # an output without a gradient is skipped, not zeroed
        ctx.dims = (b, s, heads, kv_heads, d, per_batch)
        return q_BSHD, k_BSKD, v_BSKD

    @staticmethod
    @once_differentiable
    def backward(ctx, dq_BSHD, dk_BSKD, dv_BSKD):
        cos_BSD, sin_BSD = ctx.saved_tensors
        b, s, heads, kv_heads, d, per_batch = ctx.dims
        grads = [None if g is None else g.contiguous() for g in (dq_BSHD, dk_BSKD, dv_BSKD)]
        dqkv_BSXD = cos_BSD.new_empty((b, s, heads + 2 * kv_heads, d))
        _ops.rope_qkv_bwd(
            *(0 if g is None else g.data_ptr() for g in grads), cos_BSD.data_ptr(),
            sin_BSD.data_ptr(), dqkv_BSXD.data_ptr(), b, s, heads, kv_heads, d, per_batch,
            _threads(),
        )  # fmt: skip
        return dqkv_BSXD, None, None, None, None


def rotary_qkv(
    qkv_BSXD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.rotary.rotary_qkv's CPU backend: q, k rotated and v copied out in one pass."""
    b = qkv_BSXD.shape[0]
    if (
        qkv_BSXD.numel()
        and qkv_BSXD.shape[-1] % 2 == 0
        and cos_BSD.shape[0] in (1, b)
        and applies(qkv_BSXD, cos_BSD, sin_BSD)
    ):
        return _RotaryQKV.apply(qkv_BSXD, cos_BSD, sin_BSD, heads, kv_heads)
    return rotary_qkv_reference(qkv_BSXD, cos_BSD, sin_BSD, heads, kv_heads)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, labels_N, valid_N, z_loss_weight):
        n, v = logits_NV.shape
        loss_N = torch.empty(n, dtype=torch.float32)
        lse_N = torch.empty(n, dtype=torch.float32)
        _ops.ce_fwd(
            logits_NV.data_ptr(), labels_N.data_ptr(), valid_N.data_ptr(), loss_N.data_ptr(),
            lse_N.data_ptr(), n, v, z_loss_weight, _threads(),
        )  # fmt: skip
        ctx.save_for_backward(logits_NV, labels_N, valid_N, lse_N)
        ctx.z_loss_weight = z_loss_weight
        return loss_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_N):
        logits_NV, labels_N, valid_N, lse_N = ctx.saved_tensors
        weight_N = torch.where(valid_N, grad_N.float(), 0.0).contiguous()
        grad_NV = torch.empty_like(logits_NV)
        n, v = logits_NV.shape
        _ops.ce_bwd(
            logits_NV.data_ptr(), labels_N.data_ptr(), lse_N.data_ptr(), weight_N.data_ptr(),
            grad_NV.data_ptr(), n, v, ctx.z_loss_weight, _threads(),
        )  # fmt: skip
        return grad_NV, None, None, None


def per_token(
    logits_NV: torch.Tensor,
    labels_N: torch.Tensor,
    valid_N: torch.Tensor,
    z_loss_weight: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """kernels.cross_entropy's CPU backend: fp32 per-token loss, one pass per direction while
    training (no chunks: nothing of [N, V] is allocated but the gradient); otherwise the chunked
    backend."""
    if (
        logits_NV.numel()
        and labels_N.dtype == torch.int64
        and labels_N.is_contiguous()
        and valid_N.dtype == torch.bool
        and valid_N.is_contiguous()
        and applies(logits_NV)
    ):
        return _CrossEntropy.apply(logits_NV, labels_N, valid_N, float(z_loss_weight))
    return per_token_chunked(logits_NV, labels_N, valid_N, z_loss_weight, chunk_size)


ATTENTION_MAX_SEQ = 2048
"""The longest sequence the fused attention takes: its backward holds two [S, S] fp32 tables per
working thread (32 MiB at 2048); longer sequences run sdpa's flash kernel."""
ATTENTION_MAX_SCRATCH = 256 * 2**20
"""The most scratch memory the fused attention's backward may hold over all its threads (two
[S, S] fp32 tables each, one thread per (batch, kv head) at most); above it sdpa runs."""


def _attention_scratch_bytes(batch: int, kv_heads: int, seq: int) -> int:
    padded = -(-seq // 16) * 16
    return min(_threads(), batch * kv_heads) * 2 * padded * padded * 4


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BSHD, k_BSKD, v_BSKD, scale):
        b, s, h, d = q_BSHD.shape
        kv = k_BSKD.shape[2]
        out_BSHD = torch.empty_like(q_BSHD)
        lse_BHS = q_BSHD.new_empty((b, h, s))
        _ops.attn_fwd(
            q_BSHD.data_ptr(), k_BSKD.data_ptr(), v_BSKD.data_ptr(), out_BSHD.data_ptr(),
            lse_BHS.data_ptr(), b, s, h, kv, d, scale, _threads(),
        )  # fmt: skip
        ctx.save_for_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS)
        ctx.scale = scale
        return out_BSHD

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_BSHD):
        q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS = ctx.saved_tensors
        b, s, h, d = q_BSHD.shape
        kv = k_BSKD.shape[2]
        dout_BSHD = dout_BSHD.contiguous()
        dq_BSHD = torch.empty_like(q_BSHD)
        dk_BSKD = torch.empty_like(k_BSKD)
        dv_BSKD = torch.empty_like(v_BSKD)
        _ops.attn_bwd(
            q_BSHD.data_ptr(), k_BSKD.data_ptr(), v_BSKD.data_ptr(), out_BSHD.data_ptr(),
            dout_BSHD.data_ptr(), lse_BHS.data_ptr(), dq_BSHD.data_ptr(), dk_BSKD.data_ptr(),
            dv_BSKD.data_ptr(), b, s, h, kv, d, ctx.scale, _threads(),
        )  # fmt: skip
        return dq_BSHD, dk_BSKD, dv_BSKD, None


def attention(
    q_BSHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.attention's CPU backend: causal self-attention of a training step in C (no mask
    but the causal one, no lse returned, head dim a multiple of 16, S <= ATTENTION_MAX_SEQ and
    backward scratch within ATTENTION_MAX_SCRATCH); every other call runs the sdpa backend."""
    if (
        spec.simple_causal
        and spec.q_len == spec.k_len <= ATTENTION_MAX_SEQ
        and spec.head_dim % 16 == 0
        and spec.dropout_p == 0
        and not spec.return_lse
        and q_BSHD.numel()
        and applies(q_BSHD, k_BSKD, v_BSKD)  # before the scratch check: declines while tracing
        and _attention_scratch_bytes(spec.batch, spec.kv_heads, spec.q_len) <= ATTENTION_MAX_SCRATCH
    ):
        return _Attention.apply(q_BSHD, k_BSKD, v_BSKD, spec.scale), None
    return attention_sdpa(q_BSHD, k_BSKD, v_BSKD, spec)
