"""Training forward+backward throughput of Meshline's CausalLM vs HF `LlamaForCausalLM`.

    python -m bench.bench_models [--quick] [--dtype fp32|bf16] [--threads 2]

Both models get the same config, weights (through the HF adapter), dtype, batch and loss
(cross entropy over the logits, computed identically outside the model); HF uses its default
attention implementation (SDPA). Steps alternate ours / HF so that machine noise hits both, and
the median step time of each gives tokens/s. The headline ratio ours / HF (> 1: ours faster)
is the median over adjacent (ours, HF) step pairs, which resists load from other processes on a
shared machine; median wall-clock, best wall-clock and process-CPU-time ratios are printed too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from models import build_model
from models.hf_adapters import from_hf, hf_config
from models.registry import get_config


def _models(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = get_config(
        "tiny-llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_kv_heads=args.kv_heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config(config))).to(dtype)
    ours = build_model(config, device="cpu", dtype=dtype)
    ours.load_state_dict(from_hf(hf.state_dict(), config))
    return config, ours.train(), hf.train()


def _step(model, ids: torch.Tensor, hf: bool) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward + loss + backward."""
    wall, cpu = time.perf_counter(), time.process_time()
    logits = model(input_ids=ids).logits if hf else model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print tokens/s of both and the ratio."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_models", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=8000)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.ffn, args.layers, args.seq, args.steps = 256, 688, 2, 128, 6
    torch.set_num_threads(args.threads)
    config, ours, hf = _models(args)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    with torch.no_grad():
        diff = (ours(ids).float() - hf(input_ids=ids).logits.float()).abs().max().item()
    for _ in range(2):  # warm-up: allocator, thread pools, lazy inits
        _step(ours, ids, hf=False)
        _step(hf, ids, hf=True)
    ours_s, hf_s = [], []
    for _ in range(args.steps):
        ours_s.append(_step(ours, ids, hf=False))
        hf_s.append(_step(hf, ids, hf=True))
    tokens = args.batch * args.seq
    ours_tps = tokens / statistics.median(t for t, _ in ours_s)
    hf_tps = tokens / statistics.median(t for t, _ in hf_s)
    cpu_ratio = statistics.median(c for _, c in hf_s) / statistics.median(c for _, c in ours_s)
    best_ratio = min(t for t, _ in hf_s) / min(t for t, _ in ours_s)
    # Adjacent steps see similar machine load: the median of per-pair ratios resists noise best.
    pair_ratio = statistics.median(h / o for (h, _), (o, _) in zip(hf_s, ours_s, strict=True))
    print(
        f"config: hidden={args.hidden} layers={args.layers} heads={args.heads} "
        f"kv_heads={args.kv_heads} ffn={args.ffn} vocab={args.vocab} batch={args.batch} "
        f"seq={args.seq} dtype={args.dtype} threads={args.threads} steps={args.steps} "
        f"(max |logit diff| {diff:.2e})"
    )
    print(f"meshline  fwd+bwd {ours_tps:10.1f} tokens/s")
    print(f"hf llama  fwd+bwd {hf_tps:10.1f} tokens/s")
    print(
        f"ratio ours/hf: {pair_ratio:.2f}x (median of adjacent-step ratios); "
        f"{ours_tps / hf_tps:.2f}x median wall-clock, {best_ratio:.2f}x best wall-clock, "
        f"{cpu_ratio:.2f}x median process CPU time"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
