"""Kernel timings on this device: each backend vs its reference and vs HF's equivalent.

    python -m bench.bench_kernels [--quick] [--dtype fp32|bf16] [--threads 2]

Rows time one op (forward, or forward+backward where marked) with torch.utils.benchmark.Timer
(blocked_autorange), in rounds alternating baseline and ours, reporting each one's median over
rounds so that load drifting on a shared machine hits both alike. The speedup column is baseline time / our time, so > 1 means the
Meshline kernel is faster; the baseline of each row is named in it. Baselines: transformers'
LlamaRMSNorm, apply_rotary_pos_emb and SDPA attention (transformers.models.llama.modeling_llama
and transformers.integrations.sdpa_attention), torch's F.cross_entropy on fp32 logits and
torch's AdamW, all run in the same process on the same inputs.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from kernels import activation, attention, norm, rotary
from kernels.cross_entropy import chunk_grad, chunk_loss, cross_entropy, per_token_chunked
from kernels.optim import build_optimizer


def _time(fn: Callable[[], object], min_run_time: float) -> float:
    """Median seconds per call."""
    fn()  # warm-up: first-call allocations and lazy imports
    return (
        Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median
    )


def _fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def run() -> None:
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
        for x in leaves:
            x.grad = None

    return run


class Table:
    """Rows of (op, implementation, time, baseline name, speedup).

    A shared machine's load drifts, so each group is timed in `rounds` rounds that alternate
    baseline and ours; each implementation's time is the median over rounds.
    """

    def __init__(self, min_run_time: float, rounds: int) -> None:
        self.min_run_time = min_run_time
        self.rounds = rounds
        self.rows: list[tuple[str, str, float, str, float]] = []

    def group(
        self,
        op: str,
        baseline: tuple[str, Callable[[], object]],
        ours: dict[str, Callable[[], object]],
    ) -> None:
        """Time the baseline and each of ours, recording speedups against the baseline."""
        base_name, base_fn = baseline
        fns = {base_name: base_fn, **ours}
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(self.rounds):
            for name, fn in fns.items():
                samples[name].append(_time(fn, self.min_run_time))
        times = {name: statistics.median(ts) for name, ts in samples.items()}
        for name, t in times.items():
            speedup = times[base_name] / t
            self.rows.append((op, name, t, base_name, speedup))
            print(
                f"  {op:<50} {name:<28} {t * 1e3:9.3f} ms  x{speedup:6.2f} vs {base_name}",
                flush=True,
            )

    def print(self) -> None:
        print(f"\n{'op':<50} {'implementation':<28} {'ms':>9}  {'speedup':>8}  baseline")
        for op, name, t, base, speedup in self.rows:
            print(f"{op:<50} {name:<28} {t * 1e3:9.3f}  {speedup:8.2f}  {base}")


def bench_norm_rotary_activation(
    table: Table, args: argparse.Namespace, dtype: torch.dtype
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    B, S, H, D = args.batch, args.seq, args.heads, args.head_dim
    E = H * D
    x = torch.randn(B, S, E, dtype=dtype)
    hf_norm = LlamaRMSNorm(E).to(dtype)
    ours_norm = norm.RMSNorm(E, dtype=dtype)
    w, eps = ours_norm.weight, ours_norm.eps
    table.group(
        f"rms_norm fwd+bwd [{B}x{S}x{E}]",
        ("HF LlamaRMSNorm", _fwd_bwd(hf_norm, x)),
        {
            f"ours ({norm.RMS_NORM.default()})": _fwd_bwd(ours_norm, x),
            **_variants(x, norm.rms_norm_reference, lambda f: _fwd_bwd(lambda x: f(x, w, eps), x)),
        },
    )
    q = torch.randn(B, S, H, D, dtype=dtype)
    k = torch.randn(B, S, H, D, dtype=dtype)
    cos, sin = rotary.RotaryEmbedding(D)(torch.arange(S).expand(B, S))
    cos_hf, sin_hf = cos.to(dtype), sin.to(dtype)

    def hf_rope(q, k):
        q2, k2 = apply_rotary_pos_emb(q, k, cos_hf, sin_hf, unsqueeze_dim=2)
        return q2 + k2

    def ours_rope(q, k, **kw):
        return rotary.apply_rotary(q, cos, sin, **kw) + rotary.apply_rotary(k, cos, sin, **kw)

    table.group(
        f"rotary q+k fwd+bwd [{B}x{S}x{H}x{D}]",
        ("HF apply_rotary_pos_emb", _fwd_bwd(hf_rope, q, k)),
        {
            "ours half": _fwd_bwd(ours_rope, q, k),
            "ours interleaved": _fwd_bwd(lambda q, k: ours_rope(q, k, interleaved=True), q, k),
            **_variants(
                q,
                rotary.apply_rotary_reference,
                lambda f: _fwd_bwd(
                    lambda q, k: f(q, cos, sin, False) + f(k, cos, sin, False), q, k
                ),
            ),
        },
    )
    F_ = args.ffn
    gate_up = torch.randn(B, S, 2 * F_, dtype=dtype)
    gate, up = gate_up.chunk(2, -1)
    table.group(
        f"swiglu fwd+bwd [{B}x{S}x{F_}]",
        (
            "HF silu(gate)*up",
            _fwd_bwd(lambda g, u: F.silu(g) * u, gate.contiguous(), up.contiguous()),
        ),
        {
            "ours swiglu": _fwd_bwd(activation.swiglu, gate.contiguous(), up.contiguous()),
            "ours swiglu_packed": _fwd_bwd(activation.swiglu_packed, gate_up),
            **_variants(
                gate,
                activation.swiglu_reference,
                lambda f: _fwd_bwd(f, gate.contiguous(), up.contiguous()),
            ),
            **_variants(
                gate, activation.swiglu_packed_reference, lambda f: _fwd_bwd(f, gate_up), "packed "
            ),
        },
    )


def bench_attention(table: Table, args: argparse.Namespace, dtype: torch.dtype) -> None:
    from torch import nn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, S, H, K, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, S, H, D, dtype=dtype)
    k = torch.randn(B, S, K, D, dtype=dtype)
    v = torch.randn(B, S, K, D, dtype=dtype)
    module = nn.Module()
    module.num_key_value_groups = H // K
    module.is_causal = True

    def hf(q, k, v):
        out, _ = sdpa_attention_forward(
            module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, scaling=D**-0.5
        )
        return out

    def ours(backend, **kw):
        return lambda q, k, v: attention.attention(q, k, v, backend=backend, **kw)

    label = f"[B{B} S{S} H{H} K{K} D{D}]"
    backends = [b for b in attention.ATTENTION.available() if b != "reference"] + ["reference"]
    table.group(
        f"attention causal fwd+bwd {label}",
        ("HF sdpa_attention_forward", _fwd_bwd(hf, q, k, v)),
        {f"ours {b}": _fwd_bwd(ours(b), q, k, v) for b in backends},
    )
    with_lse = [b for b in backends[:-1] if _accepts(ours(b, return_lse=True), q, k, v)]
    table.group(
        f"attention causal +lse fwd+bwd {label}",
        ("ours reference +lse", _fwd_bwd(ours("reference", return_lse=True), q, k, v)),
        {f"ours {b} +lse": _fwd_bwd(ours(b, return_lse=True), q, k, v) for b in with_lse},
    )
    lengths = [S // 4, S // 2, S - S // 4 - S // 2]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(B, S)
    packed = [b for b in backends[:-1] if _accepts(ours(b, segment_ids_BS=seg), q, k, v)]
    table.group(
        f"attention packed(3 docs) fwd+bwd {label}",
        ("ours reference", _fwd_bwd(ours("reference", segment_ids_BS=seg), q, k, v)),
        {f"ours {b}": _fwd_bwd(ours(b, segment_ids_BS=seg), q, k, v) for b in packed},
    )


def _accepts(fn: Callable[..., object], *inputs: torch.Tensor) -> bool:
    """Whether a backend takes this call on this device (an explicit backend that cannot run it
    raises ValueError, e.g. SDPA's lse path, which exists on CPU only)."""
    try:
        fn(*inputs)
    except ValueError:
        return False
    return True


def bench_cross_entropy(table: Table, args: argparse.Namespace, dtype: torch.dtype) -> None:
    N, V = args.batch * args.seq, args.vocab
    logits = torch.randn(N, V, dtype=dtype)
    labels = torch.randint(0, V, (N,))
    table.group(
        f"cross_entropy fwd+bwd [N{N} V{V}]",
        (
            "torch F.cross_entropy(fp32)",
            _fwd_bwd(lambda x: F.cross_entropy(x.float(), labels), logits),
        ),
        {
            "ours reference": _fwd_bwd(
                lambda x: cross_entropy(x, labels, backend="reference"), logits
            ),
            "ours chunked (auto)": _fwd_bwd(lambda x: cross_entropy(x, labels), logits),
            f"ours chunk={N // 4}": _fwd_bwd(
                lambda x: cross_entropy(x, labels, chunk_size=N // 4), logits
            ),
            **_chunked_variants(logits, labels),
        },
    )


def _variants(
    like: torch.Tensor,
    reference: Callable[..., torch.Tensor],
    timed: Callable[[Callable[..., torch.Tensor]], Callable[[], None]],
    prefix: str = "",
) -> dict[str, Callable[[], None]]:
    """On CUDA, diagnosis rows beside the registered backend: the op's reference run eagerly,
    and compiled with static shapes (dynamic=False) rather than the backends' dynamic=True."""
    if like.device.type != "cuda":
        return {}
    return {
        f"{prefix}reference eager": timed(reference),
        f"{prefix}compiled static": timed(torch.compile(reference, dynamic=False)),
    }


def _chunked_variants(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Callable[[], None]]:
    """On CUDA: the chunked loss with plain (eager) and static-shape compiled chunk functions,
    in one chunk and in four."""
    if logits.device.type != "cuda":
        return {}

    n = logits.shape[0]
    valid = torch.ones(n, dtype=torch.bool)
    static = (torch.compile(chunk_loss, dynamic=False), torch.compile(chunk_grad, dynamic=False))
    rows: dict[str, Callable[[], None]] = {}
    for chunk in (n, n // 4):
        for name, fns in (("eager", (chunk_loss, chunk_grad)), ("static", static)):
            rows[f"chunked {name} chunk={chunk}"] = _fwd_bwd(
                lambda x, c=chunk, f=fns: per_token_chunked(x, labels, valid, 0.0, c, chunk_fns=f),
                logits,
            )
    return rows


def bench_optimizers(table: Table, args: argparse.Namespace) -> None:
    shapes = [(args.ffn, args.heads * args.head_dim)] * 4 + [(args.heads * args.head_dim,)] * 4
    numel = sum(math.prod(s) for s in shapes)

    def stepper(name: str, **kw) -> Callable[[], None]:
        params = [torch.randn(s, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = build_optimizer(name, params, lr=1e-4, weight_decay=0.1, **kw)
        return opt.step

    table.group(
        f"optimizer step [{numel / 1e6:.2f}M params]",
        ("torch AdamW (for-loop)", stepper_for_loop(shapes)),
        {
            "adamw (foreach)": stepper("adamw"),
            "fused_adam": stepper("fused_adam"),
            "cadam fp16": stepper("cadam"),
            "cadam fp32": stepper("cadam", compute_dtype=torch.float32),
        },
    )


def stepper_for_loop(shapes) -> Callable[[], None]:
    """torch's single-tensor AdamW: the baseline the foreach/fused paths replace."""
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False).step


def main(argv: list[str] | None = None) -> int:
    """Time every kernel group and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_kernels", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes, short timing windows")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = dict(batch=2, seq=512, heads=8, kv_heads=2, head_dim=64, ffn=1408, vocab=32000)
    if args.quick:
        shape = dict(batch=1, seq=256, heads=4, kv_heads=2, head_dim=32, ffn=352, vocab=8000)
    for key, value in shape.items():
        setattr(args, key, value)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    table = Table(min_run_time=0.1 if args.quick else 0.3, rounds=3 if args.quick else 5)
    print(
        f"bench_kernels: dtype={args.dtype} threads={args.threads} {shape} torch={torch.__version__}"
    )
    bench_norm_rotary_activation(table, args, dtype)
    bench_attention(table, args, dtype)
    bench_cross_entropy(table, args, dtype)
    bench_optimizers(table, args)
    table.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
