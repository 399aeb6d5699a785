"""The memory ladder against a fixed host-memory budget: the largest model each rung trains.

    python -m bench.bench_ladder --budget-mib 1100 [--steps 3] [--quick]

Each rung (DDP → ZeRO-1 → ZeRO-3 → + optimizer offload to the CPU → + the NVMe tier) trains a
Llama-style model (hidden `--hidden`, GQA, vocab `--vocab`) on DP2 gloo processes through
`training.loop.Trainer` for `--steps` steps; one trial is one fresh pair of processes, and its
measure is the larger rank's peak resident set (VmHWM: no cgroup, the kernel's own peak count).
A trial fits when that peak is at most the budget. Per rung: trials at `--probe` layer counts
give a slope, the predicted largest fitting depth is tried, and the depth moves one layer at a
time until a depth fits and the next does not — the reported largest is measured, not predicted.
Every rung also runs the first probe depth, so the rungs' peaks for one model sit side by side
with their losses against the DDP rung.

The trial processes run with glibc's mmap threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_`,
set before they start; `--default-malloc` leaves glibc's dynamic threshold): every tensor over
64 KiB is its own mapping, returned to the kernel when freed, so the peak resident set follows
the bytes the rung holds. With the dynamic threshold glibc raises the threshold to the largest
block freed (up to 32 MiB), after which FSDP2's per-layer gathers and the activations come from
the heap and stay resident once freed: the peak then measures the allocator's high-water mark,
which hid ZeRO-3's saving entirely in a first run (bench/RESULTS.md).

On a CPU run the "device" is the host: offloading the optimizer to the CPU moves nothing out of
the process (that rung is expected to fit what ZeRO-3 fits); sharding (ZeRO) and the NVMe tier
(m and v in swap files) do. The top rung (`PARAM_NVME_RUNG`) moves ZeRO-3's parameter shards
into a swap file too (`--cpu-offload --param-nvme-path`, parallel/param_swap.py); give it
`--max-layers 128`, its largest model is deeper than the default bound.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch

from bench.bench_zero import status_bytes

WORLD = 2
RUNGS = {
    "DDP (ZeRO-0)": ["--zero-stage", "0"],
    "ZeRO-1": ["--zero-stage", "1"],
    "ZeRO-3": ["--zero-stage", "3"],
    "ZeRO-3 + optimizer offload (cpu)": ["--zero-stage", "3", "--optimizer-cpu-offload"],
    "ZeRO-3 + optimizer offload (NVMe)": [
        "--zero-stage", "3", "--optimizer-cpu-offload", "--optimizer-nvme-path",
    ],
}  # fmt: skip
PARAM_NVME_RUNG = "ZeRO-3 + param NVMe"
"""The top rung (issue #42): ZeRO-3's parameter shards in a swap file as well (--param-nvme-path)."""
RUNGS[PARAM_NVME_RUNG] = [
    *RUNGS["ZeRO-3 + optimizer offload (NVMe)"], "--cpu-offload", "--param-nvme-path",
]  # fmt: skip


def _with_swap_dirs(flags: list[str], swap: str) -> list[str]:
    """`flags` with a directory under `swap` after each `--*-nvme-path` flag (one per flag)."""
    out: list[str] = []
    for flag in flags:
        out.append(flag)
        if flag.endswith("-nvme-path"):
            out.append(os.path.join(swap, flag.strip("-")))
    return out


def _rank(rank: int, world_size: int, flags: list[str], layers: int, args: dict) -> dict:
    from torch.distributed.tensor import DTensor

    # in the spawned rank, after run_distributed has set its environment
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    torch.set_num_threads(1)
    hidden = args["hidden"]
    base = ["--model", "tiny-llama-gqa", "--num-layers", str(layers),
            "--hidden-size", str(hidden), "--ffn-hidden-size", str(4 * hidden),
            "--num-attention-heads", "8", "--num-query-groups", "4",
            "--vocab-size", str(args["vocab"]), "--mock-data", "--seq-length", str(args["seq"]),
            "--micro-batch-size", "2", "--global-batch-size", str(2 * world_size),
            "--eval-interval", "0", "--lr", "1e-3", "--log-interval", "1000",
            "--train-iters", str(args["steps"])]  # fmt: skip
    trainer = Trainer(parse_args([*base, *flags]))
    losses = [trainer.train_step().loss for _ in range(args["steps"])]
    params = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.model.parameters()
    )
    gc.collect()
    return {"losses": losses, "peak": status_bytes("VmHWM"), "params": params}


class Ladder:
    """Trials of one bench run, cached by (rung, layers)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.swap = tempfile.mkdtemp(prefix="bench_ladder_nvme_")
        self.trials: dict[tuple[str, int], dict] = {}

    def trial(self, rung: str, layers: int) -> dict:
        """Peak RSS (larger rank), losses and total parameters of `layers` layers at `rung`."""
        from tests.harness import run_distributed

        key = (rung, layers)
        if key not in self.trials:
            flags = _with_swap_dirs(RUNGS[rung], self.swap)
            start = time.perf_counter()
            ranks = run_distributed(_rank, WORLD, flags, layers, vars(self.args))
            result = {
                "peak": max(r["peak"] for r in ranks),
                "losses": [x for r in ranks for x in r["losses"]],
                "seconds": time.perf_counter() - start,
            }
            self.trials[key] = result
            print(
                f"  trial {rung:36s} layers={layers:3d} peak={result['peak'] / 2**20:8.1f} MiB "
                f"{'fits' if self.fits(result) else 'over'} ({result['seconds']:.0f} s)",
                flush=True,
            )
        return self.trials[key]

    def fits(self, result: dict) -> bool:
        """Whether a trial's peak is within the budget."""
        return result["peak"] <= self.args.budget_mib * 2**20

    def largest(self, rung: str) -> int:
        """The largest depth that fits while the next does not (0: not even one layer)."""
        low, high = self.args.probe
        a, b = self.trial(rung, low)["peak"], self.trial(rung, high)["peak"]
        slope = max((b - a) / (high - low), 1.0)
        guess = int(low + (self.args.budget_mib * 2**20 - a) / slope)
        layers = min(max(guess, 1), self.args.max_layers)
        if self.fits(self.trial(rung, layers)):
            while layers < self.args.max_layers and self.fits(self.trial(rung, layers + 1)):
                layers += 1
            return layers
        while layers > 1:
            layers -= 1
            if self.fits(self.trial(rung, layers)):
                return layers
        return 0


def _layer_params(args: argparse.Namespace, layers: int) -> int:
    # not at the top: the spawned ranks import this module, and their peak memory is the measurement
    from models.accounting import count_parameters
    from models.registry import get_config

    config = get_config(
        "tiny-llama-gqa",
        num_layers=layers,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_attention_heads=8,
        num_kv_heads=4,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
    )
    return count_parameters(config)


def main(argv: list[str] | None = None) -> int:
    """Find each rung's largest depth within the budget; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=1100.0, help="peak RSS per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--probe", type=int, nargs=2, default=(4, 12), help="slope depths")
    parser.add_argument("--max-layers", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="hidden 128, probes 2 and 4")
    parser.add_argument("--rungs", nargs="+", choices=list(RUNGS), help="default: all")
    parser.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's dynamic mmap threshold"
    )
    args = parser.parse_args(argv)
    if not args.default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by the trial processes
    if args.quick:
        args.hidden, args.probe, args.max_layers = 128, (2, 4), 8
    ladder = Ladder(args)
    found = {}
    rungs = args.rungs or list(RUNGS)
    for rung in rungs:
        found[rung] = ladder.largest(rung)
    first = args.probe[0]
    base = ladder.trials[(rungs[0], first)]
    print(
        f"config: DP{WORLD} gloo CPU (the device is the host), llama hidden={args.hidden} "
        f"GQA 8/4 heads, vocab={args.vocab}, seq={args.seq}, micro-batch 2/rank, AdamW fp32, "
        f"{args.steps} steps a trial; budget {args.budget_mib:.0f} MiB peak RSS per rank"
    )
    print(
        f"{'rung':36s} {'largest layers':>14s} {'params':>10s} {'its peak MiB':>12s} "
        f"{'next peak MiB':>13s}  | at {first} layers: {'peak MiB':>8s} max |loss - first rung|"
    )
    for rung, layers in found.items():
        fit = ladder.trials.get((rung, layers))
        over = ladder.trials.get((rung, layers + 1))
        same = ladder.trials[(rung, first)]
        diff = max(abs(x - y) for x, y in zip(same["losses"], base["losses"], strict=True))
        print(
            f"{rung:36s} {layers:14d} {_layer_params(args, layers) / 1e6:9.1f}M "
            f"{(fit['peak'] / 2**20 if fit else float('nan')):12.1f} "
            f"{(over['peak'] / 2**20 if over else float('nan')):13.1f}  | "
            f"{same['peak'] / 2**20:17.1f} {diff:.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
