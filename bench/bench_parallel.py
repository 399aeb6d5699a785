"""Parallel layouts on CPU/gloo: step time, peak memory per rank vs `meshline estimate`, bubble.

    python bench/bench_parallel.py [--quick] [--steps N]
    python bench/bench_parallel.py --overlap [--steps N]     # overlap switches on vs off
    python bench/bench_parallel.py --recompute [--steps N]   # peak step memory: none/selective/full

For every layout the single-process run is timed in the same invocation (the baseline); each row
prints the layout's step time, its ratio to the baseline, the largest per-rank peak RSS growth
during training and the `models.memory` (`meshline estimate`) device total for that layout. For
pipeline layouts the measured bubble is 1 - (baseline / P) / step time, against the schedule's
formula (p-1)/m for 1F1B and (p-1)/(v·m) with v virtual chunks. On a shared CPU the processes
compete for cores, so ratios mix parallel overhead with contention: read them as relative costs.

`--overlap` times PP2 x DP2 (ZeRO-1 and ZeRO-3) with and without `--overlap-grad-reduce`, and
TP2 x DP2 ZeRO-3 with `--zero3-prefetch-layers` 0 and 2; the baseline of each pair is the run
without the switch. `--recompute` runs one process with no / selective / full activation
recompute and reports each one's peak memory during a training step above what was live at its
start (torch profiler allocation events, so allocator bytes, not RSS: comparable with a device's
`max_memory_allocated`) and its step time, against no recompute.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Run as a script, the repo root is importable only from here on.
from models.memory import TrainingLayout, estimate
from models.registry import get_config

MODEL = ["--model", "tiny-llama-gqa", "--num-layers", "4", "--mock-data", "--seq-length", "64",
         "--micro-batch-size", "2", "--eval-interval", "0", "--lr", "1e-3",
         "--log-interval", "100000"]  # fmt: skip
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2-v2": (2, ["--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1"]),
    "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}  # fmt: skip
QUICK = ("tp2", "pp2-1f1b")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _timed(rank: int, world_size: int, flags: list[str], steps: int) -> dict[str, float]:
    """Body: build the trainer, one warm-up step, then time `steps` steps."""
    import torch.distributed as dist

    # in the spawned rank, after run_distributed has set its environment
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    trainer = Trainer(parse_args([*MODEL, "--train-iters", str(steps + 1), *flags]))
    before = _rss()
    trainer.train_step()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    peak = _rss()
    for _ in range(steps):
        trainer.train_step()
        peak = max(peak, _rss())
    return {"step_s": (time.perf_counter() - start) / steps, "rss_growth": peak - before}


OVERLAP_PAIRS: dict[str, tuple[list[str], list[str]]] = {
    "pp2-dp2-zero1": (["--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
                      ["--overlap-grad-reduce"]),
    "pp2-dp2-zero3": (["--pipeline-model-parallel-size", "2", "--zero-stage", "3"],
                      ["--overlap-grad-reduce"]),
    "tp2-dp2-zero3": (["--tensor-model-parallel-size", "2", "--zero-stage", "3"],
                      ["--zero3-prefetch-layers", "2"]),
}  # fmt: skip
RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full"],
}
# Longer sequences for the recompute table: activations, not weights, should dominate.
RECOMPUTE_MODEL = [
    "--seq-length",
    "256",
    "--max-position-embeddings",
    "256",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
]


def _step_memory(rank: int, world_size: int, flags: list[str], steps: int) -> dict[str, float]:
    """Body: peak allocator bytes during one step above those live at its start, and step time."""
    from torch.profiler import ProfilerActivity, profile

    # in the spawned rank, after run_distributed has set its environment
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    trainer = Trainer(parse_args([*MODEL, *RECOMPUTE_MODEL, "--train-iters", str(steps + 2),
                                  *flags]))  # fmt: skip
    trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step()
    # Each op's net allocation at its start time: the running sum is live memory at op borders.
    deltas = sorted(
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    )
    live = peak = 0
    for _, delta in deltas:
        live += delta
        peak = max(peak, live)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return {"peak": float(peak), "step_s": (time.perf_counter() - start) / steps}


def _overlap(steps: int, gbs: list[str]) -> None:
    from tests.harness import run_distributed

    print(f"model tiny-llama-gqa 4 layers, seq 64, mbs 2, gbs {gbs[1]}, fp32, gloo, 4 ranks")
    print(f"{'layout':<15} {'switch':<26} {'step s':>8} {'ratio':>6}")
    for name, (flags, switch) in OVERLAP_PAIRS.items():
        base = max(r["step_s"] for r in run_distributed(_timed, 4, [*gbs, *flags], steps))
        rows = run_distributed(_timed, 4, [*gbs, *flags, *switch], steps)
        step = max(r["step_s"] for r in rows)
        print(f"{name:<15} {'(off)':<26} {base:>8.3f} {1.0:>6.2f}")
        print(f"{name:<15} {' '.join(switch):<26} {step:>8.3f} {step / base:>6.2f}")


def _recompute(steps: int) -> None:
    from tests.harness import run_distributed

    print("model tiny-llama-gqa 4 layers, seq 256, mbs 4, gbs 8 (2 micro-batches), fp32, 1 process")
    print(f"{'recompute':<10} {'peak MiB':>9} {'ratio':>6} {'step s':>8} {'ratio':>6}")
    base: dict[str, float] = {}
    for name, flags in RECOMPUTE.items():
        row = run_distributed(_step_memory, 1, flags, steps)[0]
        base = base or row
        print(f"{name:<10} {row['peak'] / 2**20:>9.1f} {row['peak'] / base['peak']:>6.2f} "
              f"{row['step_s']:>8.3f} {row['step_s'] / base['step_s']:>6.2f}")  # fmt: skip


def _flag(flags: list[str], name: str, default: int = 1) -> int:
    return int(flags[flags.index(name) + 1]) if name in flags else default


def _estimate(flags: list[str], world_size: int, global_batch: int) -> float:
    """`meshline estimate`'s largest device total for this layout (bytes)."""
    tp = _flag(flags, "--tensor-model-parallel-size")
    pp = _flag(flags, "--pipeline-model-parallel-size")
    cp = _flag(flags, "--context-parallel-size")
    config = get_config("tiny-llama-gqa", num_layers=4)
    per_virtual = _flag(flags, "--num-layers-per-virtual-pipeline-stage", 0)
    layout = TrainingLayout(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=world_size // (tp * pp * cp),
        virtual_stages=(4 // pp) // per_virtual if per_virtual else 1,
        micro_batch_size=2,
        seq_length=64 // cp,
        sequence_parallel="--sequence-parallel" in flags,
    )
    return max(row.total for row in estimate(config, layout))


def main(argv: list[str] | None = None) -> int:
    """Run the layouts and print one row each."""
    from tests.harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--overlap", action="store_true", help="overlap switches on vs off")
    parser.add_argument("--recompute", action="store_true", help="peak memory per recompute mode")
    args = parser.parse_args(argv)
    gbs = ["--global-batch-size", str(args.global_batch_size)]
    if args.overlap or args.recompute:
        if args.overlap:
            _overlap(args.steps, gbs)
        if args.recompute:
            _recompute(args.steps)
        return 0
    base = run_distributed(_timed, 1, gbs, args.steps)[0]
    print(f"model tiny-llama-gqa 4 layers, seq 64, mbs 2, gbs {args.global_batch_size}, fp32, gloo")
    print(f"{'layout':<10} {'ranks':>5} {'step s':>8} {'ratio':>6} {'rss MiB':>8} "
          f"{'est MiB':>8} {'bubble':>7} {'formula':>7}")  # fmt: skip
    print(f"{'single':<10} {1:>5} {base['step_s']:>8.3f} {1.0:>6.2f} "
          f"{base['rss_growth'] / 2**20:>8.1f} {_estimate([], 1, 8) / 2**20:>8.1f}")  # fmt: skip
    names = QUICK if args.quick else tuple(LAYOUTS)
    for name in names:
        ranks, flags = LAYOUTS[name]
        rows = run_distributed(_timed, ranks, [*gbs, *flags], args.steps)
        step = max(r["step_s"] for r in rows)
        rss = max(r["rss_growth"] for r in rows) / 2**20
        est = _estimate(flags, ranks, args.global_batch_size) / 2**20
        bubble = formula = ""
        if "--pipeline-model-parallel-size" in flags:
            pp = _flag(flags, "--pipeline-model-parallel-size")
            tp = _flag(flags, "--tensor-model-parallel-size")
            virtual = 4 // pp if "--num-layers-per-virtual-pipeline-stage" in flags else 1
            micro = args.global_batch_size // 2 // (ranks // (pp * tp))
            bubble = f"{1 - (base['step_s'] / pp) / step:.2f}"
            formula = f"{(pp - 1) / (virtual * micro):.2f}"
        print(f"{name:<10} {ranks:>5} {step:>8.3f} {step / base['step_s']:>6.2f} {rss:>8.1f} "
              f"{est:>8.1f} {bubble:>7} {formula:>7}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
