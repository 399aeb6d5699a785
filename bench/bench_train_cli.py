"""`meshline train` as a user launches it vs an HF `LlamaForCausalLM` + torch AdamW loop.

    python -m bench.bench_train_cli [--quick] [--hidden 256 1024] [--rounds 2] [--steps N]

Ours: `meshline train --nproc-per-node 1 ...` in a subprocess with default flags (only the
model shape, the data `--mock-data`, `--train-iters`, `--log-interval 1` and the AdamW
hyper-parameters are given), its tokens/s read from its own per-step log lines. HF: a subprocess
training `LlamaForCausalLM` of the same config on the same batches with
`torch.optim.AdamW(params, lr, weight_decay)` (torch's defaults, as a user writes it), gradient
clipping 1.0, timing each step. Both sides use torch's default thread count. Rounds alternate
ours and HF (HF first in odd rounds); the first steps of each run are warm-up. Printed: per side
the median and best step tokens/s over all rounds, ours/HF for both, and the paired ratio: the
median over rounds of ours/HF of the two runs of a round, which a drift in the machine's speed
between rounds does not bias (> 1 = we are faster).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

SHAPES = {
    256: dict(hidden=256, layers=4, heads=8, kv=4, ffn=704, vocab=4096, seq=256, mbs=4),
    1024: dict(hidden=1024, layers=4, heads=8, kv=4, ffn=2816, vocab=4096, seq=256, mbs=4),
}
STEPS = {256: 30, 1024: 10}
QUICK_STEPS = {256: 6, 1024: 3}
WARMUP = 2
STEP_RATE = re.compile(r"tokens/s/dev ([\d,.]+)")
"""The tokens/s of one log line of `meshline train` (printed per step with --log-interval 1)."""


def model_flags(shape: dict, steps: int) -> list[str]:
    """The `meshline train` flags: the shape and the run length, nothing else."""
    return [
        "--model", "tiny-llama", "--num-layers", str(shape["layers"]),
        "--hidden-size", str(shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
        "--num-query-groups", str(shape["kv"]), "--ffn-hidden-size", str(shape["ffn"]),
        "--vocab-size", str(shape["vocab"]), "--max-position-embeddings", str(shape["seq"]),
        "--seq-length", str(shape["seq"]), "--micro-batch-size", str(shape["mbs"]),
        "--mock-data", "--train-iters", str(steps + WARMUP), "--log-interval", "1",
        "--eval-interval", "0", "--lr", "1e-4", "--weight-decay", "0.1", "--clip-grad", "1.0",
    ]  # fmt: skip


def run_ours(shape: dict, steps: int, extra: list[str] | None = None) -> list[float]:
    """Per-step tokens/s of `meshline train --nproc-per-node 1` (warm-up steps dropped)."""
    cmd = [sys.executable, "-m", "services.cli", "train", "--nproc-per-node", "1"]
    cmd += model_flags(shape, steps) + (extra or [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"meshline train failed ({out.returncode}):\n{out.stderr[-3000:]}")
    rates = [float(m.replace(",", "")) for m in STEP_RATE.findall(out.stdout + out.stderr)]
    if len(rates) != steps + WARMUP:
        raise RuntimeError(f"expected {steps + WARMUP} step lines, got:\n{out.stdout[-3000:]}")
    return rates[WARMUP:]


def run_hf(shape: dict, steps: int) -> list[float]:
    """Per-step tokens/s of the HF loop, in a child process like ours."""
    cmd = [sys.executable, "-m", "bench.bench_train_cli", "--worker", json.dumps(shape)]
    cmd += ["--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"HF worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def hf_worker(shape: dict, steps: int) -> list[float]:
    """Train HF LlamaForCausalLM on `meshline train`'s mock batches; tokens/s per step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # in the --worker child only: the process that launches both sides loads no model code
    from models.hf_adapters import hf_config
    from services.trainer.arguments import parse_args
    from training.batching import MicroBatchStream
    from training.setup import build_data, build_model_config

    config = parse_args(model_flags(shape, steps))
    (train, _), _, _ = build_data(config, dp_size=1)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config(build_model_config(config))))
    stream = MicroBatchStream(
        train, consumed_samples=0, micro_batch_size=shape["mbs"], dp_rank=0, dp_size=1
    )
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1)
    rates = []
    for _ in range(steps + WARMUP):
        start = time.perf_counter()
        batch = stream.next()
        out = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = torch.nn.functional.cross_entropy(
            out.logits.flatten(0, 1).float(), batch["labels"].flatten()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        rates.append(shape["mbs"] * shape["seq"] / (time.perf_counter() - start))
    return rates[WARMUP:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_train_cli", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps, one round")
    parser.add_argument("--hidden", type=int, nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--rounds", type=int, default=None, help="ours/HF alternations")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument(
        "--ours-flag",
        action="append",
        default=[],
        help="a flag added to ours (repeat; e.g. --ours-flag=--compile); the headline is none",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(hf_worker(json.loads(args.worker), args.steps)))
        return 0
    hidden = args.hidden or sorted(SHAPES)
    rounds = args.rounds or (1 if args.quick else 2)
    flags = " ".join(args.ours_flag) or "default flags"
    print(f"meshline train --nproc-per-node 1 ({flags}) vs HF + torch AdamW; {rounds} rounds")
    for h in hidden:
        shape = SHAPES[h]
        steps = args.steps or (QUICK_STEPS if args.quick else STEPS)[h]
        ours: list[float] = []
        theirs: list[float] = []
        paired: list[float] = []
        for index in range(rounds):
            # Odd rounds run HF first, so a drift in the machine's speed favours neither side.
            if index % 2:
                round_h = run_hf(shape, steps)
                round_o = run_ours(shape, steps, args.ours_flag)
            else:
                round_o = run_ours(shape, steps, args.ours_flag)
                round_h = run_hf(shape, steps)
            ours += round_o
            theirs += round_h
            paired.append(statistics.median(round_o) / statistics.median(round_h))
        med_o, med_h = statistics.median(ours), statistics.median(theirs)
        best_o, best_h = max(ours), max(theirs)
        print(
            f"hidden {h} x {shape['layers']} layers, seq {shape['seq']}, mbs {shape['mbs']}, "
            f"{steps} steps: tokens/s median ours {med_o:,.0f} HF {med_h:,.0f} -> "
            f"{med_o / med_h:.2f}x; best step ours {best_o:,.0f} HF {best_h:,.0f} -> "
            f"{best_o / best_h:.2f}x; paired (round medians) {statistics.median(paired):.2f}x "
            f"[{', '.join(f'{r:.2f}' for r in paired)}]",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
