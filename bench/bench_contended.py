"""The CPU user paths quiet and beside a fixed background load: how much of their lead over HF
they keep on a shared machine.

    python -m bench.bench_contended [--quick] [--load 2] [--train-steps 6] [--serve-rounds 2]

Runs `bench_train_cli` (`meshline train` vs HF + torch AdamW, hidden 256) and `bench_serve`
(served greedy decode over gRPC vs HF `generate`, hidden 256, batch 1) as they run on their
own, each in a child process: once on the machine as it is ("quiet"), once beside `--load`
busy processes that this benchmark starts and kills (each a Python loop that never sleeps, one
thread, no memory traffic: the same load every run). Printed per path: ours/HF quiet and
loaded (> 1 = we are faster; the benches' "paired" figure, the median over rounds of each
round's ratio), and the fraction kept, loaded / quiet (issue #43's target: >= 0.8), with the
load average before each phase: a machine already busy before the fixed load is no quiet
baseline, so say which it was when recording the figures.

Both sides run as their benches run them: ours with the services' defaults (cgroup-sized
threads, OMP_WAIT_POLICY=PASSIVE set by the `services` package, docs/kernels.md), HF with
torch's defaults (its threads spin-wait at barriers); the environment this benchmark was
started with (OMP_NUM_THREADS, OMP_WAIT_POLICY) passes to both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True:\n    pass\n"
"""One busy process of the background load: a core's worth of work, no sleeps, no memory."""
TRAIN_PAIRED = re.compile(r"paired \(round medians\) ([\d.]+)x")
SERVE_PAIRED = re.compile(r"paired ([\d.]+)x")


@dataclass(frozen=True)
class Phase:
    """One pass over both paths: its name, the load average before it, ours/HF per path."""

    name: str
    """ "quiet" or "loaded"."""
    load_before: float
    """1-minute load average when the phase began (before the fixed load started)."""
    train: float
    """`meshline train` tokens/s over HF's (paired)."""
    serve: float
    """HF ms per token over served (paired): served decode's speed-up."""
    seconds: float
    """Wall time of the phase."""


@contextlib.contextmanager
def background_load(processes: int) -> Iterator[list[subprocess.Popen]]:
    """`processes` busy Python loops for the duration of the block, killed (by their ids) at
    its end, whatever happens in it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = [
        subprocess.Popen([sys.executable, "-c", SPIN], env=env, stdin=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    try:
        time.sleep(0.5)  # running before the first measurement
        yield started
    finally:
        for proc in started:
            proc.kill()
        for proc in started:
            proc.wait(30)


def run_bench(module: str, args: list[str], pattern: re.Pattern[str]) -> float:
    """Run `python -m bench.<module> args` in a child; the figure `pattern` finds in its
    output (its first group), echoing the output's last lines."""
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for line in out.stdout.strip().splitlines()[-3:]:
        print(f"    {module}: {line}", flush=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench.{module} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    found = pattern.findall(out.stdout)
    if not found:
        raise RuntimeError(f"bench.{module} printed no ratio:\n{out.stdout[-3000:]}")
    return float(found[-1])


def run_phase(name: str, load: int, train_args: list[str], serve_args: list[str]) -> Phase:
    """Both paths once, beside `load` busy processes (0: none)."""
    load_before = os.getloadavg()[0]
    print(f"  {name}: load average {load_before:.1f}, {load} busy processes", flush=True)
    start = time.perf_counter()
    with background_load(load):
        train = run_bench("bench_train_cli", train_args, TRAIN_PAIRED)
        serve = run_bench("bench_serve", serve_args, SERVE_PAIRED)
    return Phase(name, load_before, train, serve, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_contended", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one round of each bench")
    parser.add_argument("--load", type=int, default=2, help="busy background processes")
    parser.add_argument("--train-steps", type=int, default=6, help="timed steps per train run")
    parser.add_argument("--train-rounds", type=int, default=None, help="ours/HF alternations")
    parser.add_argument("--serve-rounds", type=int, default=None, help="timed decode rounds")
    args = parser.parse_args(argv)
    if args.load < 1:
        parser.error(
            f"--load must be >= 1 (busy processes beside the second pass), got {args.load}"
        )
    if args.train_steps < 1:
        parser.error(f"--train-steps must be >= 1, got {args.train_steps}")
    train_rounds = args.train_rounds or (1 if args.quick else 2)
    serve_rounds = args.serve_rounds or (1 if args.quick else 2)
    train_args = ["--hidden", "256", "--rounds", str(train_rounds)]
    train_args += ["--steps", str(args.train_steps)]
    serve_args = ["--hidden", "256", "--batch", "1", "--rounds", str(serve_rounds)]
    print(
        f"bench_contended: cpus {len(os.sched_getaffinity(0))}, background load {args.load} "
        f"busy processes; bench_train_cli {' '.join(train_args)}; bench_serve "
        f"{' '.join(serve_args)}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
        flush=True,
    )
    quiet = run_phase("quiet", 0, train_args, serve_args)
    loaded = run_phase("loaded", args.load, train_args, serve_args)
    for label, q, lo in (
        ("meshline train tokens/s / HF", quiet.train, loaded.train),
        ("served decode speed-up over HF generate", quiet.serve, loaded.serve),
    ):
        print(
            f"{label}: quiet {q:.2f}x (load avg {quiet.load_before:.1f}), beside {args.load} "
            f"busy processes {lo:.2f}x (load avg {loaded.load_before:.1f}) -> kept "
            f"{lo / q:.2f} of the quiet ratio (target >= 0.8)",
            flush=True,
        )
    print(f"phases took {quiet.seconds:.0f} s quiet, {loaded.seconds:.0f} s loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
