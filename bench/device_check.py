"""One prepared accelerator check: gpu tests, training, launch, kernel and decode benchmarks.

    python -m bench.device_check --out DIR [--smoke] [--skip-tests] [--profile] [--budget-s S]
    make device-check OUT=DIR

Uses the torch already installed (a GPU machine's own image; nothing is downloaded). On a CUDA
device it runs, within one time budget (450 s by default; each phase capped):

1. the `gpu`-marked test files (every kernel backend against its reference, forward and
   backward, bf16/fp16 tolerances as written in each test), summarised from pytest's JUnit XML;
2. training: a Llama-family model of ~1.2B parameters (hidden 2048, 16 layers, GQA 16/8 heads,
   SwiGLU 5632, vocab 32000), bf16, sequence 2048, global batch 16 by accumulation: HF
   `LlamaForCausalLM` + torch fused AdamW, Meshline's Trainer eager and with `--compile`:
   tokens/s, TFLOP/s (6N + 12·L·H·Q·T per token), MFU against the device's peak
   (kernels.peak_flops); with --profile one profiled step per side;
3. `meshline train --nproc-per-node 1` (torchrun, NCCL) on the same shape: the user's path;
4. each kernel's default backend against HF/torch eager (bench.bench_kernels);
5. decode: greedy, batch 1 and 8, 128 new tokens after a 128-token prompt, Meshline's engine
   (CUDA-graph decode steps, as served; and with --enforce-eager for diagnosis) against HF
   `generate` on the same weights (parity checked in fp32 first);
6. FP8, only when named in `--phases`: bf16 `--compile` against `--fp8 tensorwise|rowwise
   --compile`, tokens/s and the loss at step 200 (bench/device_fp8.py).
7. roofline, only when named in `--phases` (bench/device_decode.py): an 8B-shaped Llama's
   batch-1 bf16 decode against the HBM roofline (weight + KV bytes per token over the measured
   copy bandwidth, formula printed), decode at batch 8/32/64, gRPC and HTTP vs in-process, and
   bench/bench_loadgen.py's mix at 1-64 streams on the served model. It has its own cap (330 s):
   run it alone with `--phases roofline`, since the default phases spend the budget.

`--phases` runs a subset (for example `--phases tests,decode` on a short device lease).

Each measurement runs in its own child process (bench/device_workers.py), so memory and compile
caches do not carry over. Without a GPU (or with --smoke) the same steps run on tiny shapes in
seconds — what CI runs (tests/bench/test_device_check.py) to keep the script working. Writes
`report.json` and `report.md` under --out after every phase and prints the Markdown.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import device_fp8, roofline
from bench.device_decode import PARTIAL, roofline_worker
from bench.device_workers import (
    SHAPES,
    decode_worker,
    kernels_worker,
    train_flags,
    train_worker,
)
from kernels import device, peak_flops

REPO = Path(__file__).resolve().parents[1]
# Time caps in seconds: the whole check, the gpu tests, and one benchmark child (twice that for
# the --compile side). The GPU budget keeps `make device-check` within 8 minutes.
BUDGET_S = {"gpu": 450.0, "smoke": 300.0}
TESTS_CAP_S = {"gpu": 150.0, "smoke": 120.0}
CHILD_CAP_S = {"gpu": 100.0, "smoke": 120.0}
ROOFLINE_CAP_S = {"gpu": 330.0, "smoke": 240.0}
PHASES = ("tests", "train", "launch", "kernels", "decode", "fp8", "roofline")
# fp8 (three compiled training runs, ~3 min on an H200) and roofline (its own 330 s cap) are asked
# for by name: the other phases fill the default budget already.
DEFAULT_PHASES = PHASES[:-2]


def _child(args: list[str], timeout: float) -> dict[str, Any]:
    """Run `python -m bench.device_check --worker ...` and parse its last JSON line.

    A failure keeps the tail of the child's stderr in the report, so one device run is enough to
    see what broke.
    """
    if timeout < 10:
        return {"error": "skipped: the check's time budget was spent"}
    cmd = [sys.executable, "-m", "bench.device_check", *args]
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": tail}
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else "failed", "stderr_tail": "\n".join(lines[-30:])}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_launch(mode: str, timeout: float) -> dict[str, Any]:
    """The user's path: `meshline train --nproc-per-node 1` (torchrun, and NCCL on a GPU) on the
    same shape and flags as the in-process `ours` side; tokens/s is the median of the step lines
    after the warm-up steps."""
    if timeout < 10:
        return {"error": "skipped: the check's time budget was spent"}
    shape = SHAPES[mode]
    flags = [f if f != "1000" else "1" for f in train_flags(shape, mode == "gpu", False)]
    cmd = [sys.executable, "-m", "services.cli", "train", "--nproc-per-node", "1", *flags]
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    text = out.stdout + out.stderr
    rates = [
        float(match.group(1).replace(",", ""))
        for match in re.finditer(r"tokens/s/dev ([\d,]+)", text)
    ]
    measured = rates[shape["warmup"] :]
    if out.returncode != 0 or not measured:
        lines = text.strip().splitlines()
        return {"error": f"exit {out.returncode}", "stderr_tail": "\n".join(lines[-40:])}
    mfu = [float(m) / 100 for m in re.findall(r"MFU ([\d.]+)%", text)][shape["warmup"] :]
    return {
        "tokens_per_s": statistics.median(measured),
        "mfu": statistics.median(mfu) if mfu else None,
        "steps": len(measured),
    }


def gpu_test_files() -> list[str]:
    """Test files that carry a `gpu` mark: collecting only these keeps a GPU image that lacks
    the service dependencies (datasets, kubernetes, openai, ...) from failing collection."""
    return sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text(encoding="utf-8", errors="replace")
    )


def run_gpu_tests(out_dir: Path, mode: str, timeout: float) -> dict[str, Any]:
    """The `gpu`-marked tests (smoke mode: the peak-FLOP/s tests, to exercise the reporting)."""
    junit = out_dir / "gpu-tests.xml"
    if timeout < 10:
        return {"error": "skipped: the check's time budget was spent"}
    selection = (
        ["-m", "gpu", *gpu_test_files()] if mode == "gpu" else ["tests/kernels/test_peak_flops.py"]
    )
    # Compiled-kernel tests spend their time in inductor/Triton compiles (CPU-bound): spread them
    # over a few workers where xdist is installed; one GPU holds them all easily.
    workers = "4" if mode == "gpu" and importlib.util.find_spec("xdist") else "0"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["-n", workers] if importlib.util.find_spec("xdist") else []
    cmd += ["--junitxml", str(junit), *selection]
    try:
        done = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if not junit.exists():
        return {"error": "pytest wrote no report", "stdout_tail": done.stdout[-3000:]}
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    details: dict[str, str] = {}
    for case in suite.iter("testcase"):
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            text = (problem.get("message") or "") + "\n" + (problem.text or "")
            details[f"{case.get('classname')}::{case.get('name')}"] = text[-1500:]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"], "failed": sorted(details), "failure_details": details}  # fmt: skip


def environment() -> dict[str, Any]:
    """Torch version, device model and peak FLOP/s of this machine."""
    platform_ = device.current()
    peak = peak_flops.peak_tflops()
    extras: dict[str, Any] = {}
    if platform_.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        extras = {
            "cuda": torch.version.cuda,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        }
    for package in ("transformers", "triton", "flash_attn"):
        try:
            extras[package] = importlib.import_module(package).__version__
        except ImportError:
            extras[package] = None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_type": platform_.type,
        "device": platform_.device_name(),
        "peak_tflops": peak.tflops,
        "peak_source": peak.source,
        **extras,
    }


def _tests_lines(tests: dict[str, Any]) -> list[str]:
    if "error" in tests:
        return [f"Tests: {tests['error']}"]
    if not tests:
        return []
    return [
        f"Tests: {tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
        f"{tests['skipped']} skipped" + (f" — failed: {tests['failed']}" if tests["failed"] else "")
    ]


def _training_lines(report: dict[str, Any]) -> list[str]:
    """The training table: each in-process side, then the `meshline train` launch."""
    lines = ["", "| training | tokens/s | TFLOP/s | MFU | peak GiB | warm-up s | vs HF |"]
    lines.append("|---|---|---|---|---|---|---|")
    hf = report["train"].get("hf", {})
    for side, row in report["train"].items():
        if "error" in row:
            lines.append(f"| {side} | {row['error']} | | | | | |")
            continue
        ratio = row["tokens_per_s"] / hf["tokens_per_s"] if "tokens_per_s" in hf else float("nan")
        lines.append(
            f"| {side} | {row['tokens_per_s']:,.0f} | {row['tflops']:.4g} | {row['mfu']:.1%} | "
            f"{row['peak_memory_gib']:.2f} | {row['warmup_s']:.1f} | {ratio:.2f}x |"
        )
    launch = report.get("launch", {})
    if "error" in launch:
        lines.append(f"| meshline train (CLI) | {launch['error']} | | | | | |")
    elif launch:
        ratio = launch["tokens_per_s"] / hf["tokens_per_s"] if "tokens_per_s" in hf else math.nan
        mfu = f"{launch['mfu']:.1%}" if launch.get("mfu") is not None else ""
        lines.append(
            f"| meshline train (CLI) | {launch['tokens_per_s']:,.0f} | | {mfu} | | | {ratio:.2f}x |"
        )
    return lines


def _decode_lines(decode: dict[str, Any], new_tokens: int) -> list[str]:
    lines = [
        "",
        "| decode (greedy) | HF tokens/s | Meshline tokens/s | ratio | Meshline eager tokens/s |",
        "|---|---|---|---|---|",
    ]
    if "error" in decode:
        return [*lines, f"| {decode['error']} | | | | |"]
    for rows in (1, 8):
        row = decode[f"batch{rows}"]
        eager = row.get("ours_eager_tokens_per_s")
        lines.append(
            f"| batch {rows} | {row['hf_tokens_per_s']:,.0f} | {row['ours_tokens_per_s']:,.0f} "
            f"| {row['ours_tokens_per_s'] / row['hf_tokens_per_s']:.2f}x "
            f"| {'' if eager is None else f'{eager:,.0f}'} |"
        )
    lines.append(f"\ngreedy tokens identical to HF in fp32: {decode['identical_greedy']}")
    for key, value in decode.items():
        if key.startswith("shared_prefix_"):
            lines.append(
                f"{key.removeprefix('shared_prefix_')}: first {value} of {new_tokens}"
                " greedy tokens as HF's"
            )
    return lines


def _kernels_lines(kernels: dict[str, Any]) -> list[str]:
    if "error" in kernels:
        return ["", f"Kernels: {kernels['error']}"]
    if not kernels:
        return []
    return [
        "",
        f"| kernel ({kernels['dtype']}, fwd+bwd) | implementation | ms | vs baseline |",
        "|---|---|---|---|",
        *(
            f"| {row['op']} | {row['impl']} | {row['ms']:.3f} | {row['speedup']:.2f}x "
            f"({row['baseline']}) |"
            for row in kernels["rows"]
        ),
    ]


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page (what bench/RESULTS.md quotes)."""
    env = report["environment"]
    lines = [
        f"# Device check ({report['mode']}) — {report['date']}",
        "",
        f"{env['device']} ({env['device_type']}), torch {env['torch']}, peak "
        f"{env['peak_tflops']:.4g} TFLOP/s ({env['peak_source']}); shape {report['shape']}",
        "",
    ]
    lines += _tests_lines(report.get("tests", {}))
    lines += _training_lines(report)
    lines += _decode_lines(report["decode"], report["shape"]["new"])
    lines += _kernels_lines(report.get("kernels", {}))
    lines += device_fp8.markdown_lines(report.get("fp8"))
    if "roofline" in report:
        lines += roofline.markdown(report["roofline"], report["mode"])
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__)
    parser.add_argument("--out", type=Path, help="folder for report.json and report.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes even on a GPU")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        help=f"comma-separated phases to run, in the fixed order {','.join(PHASES)} (default: "
        "all but fp8 and roofline, which run when named): a rerun of one phase on a short device "
        "lease",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="wall-clock budget for the whole check in seconds (default: 450 on a GPU, 300 in "
        "smoke mode); phases left without time are reported as skipped",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile one training step of each side (profile-<side>.txt under --out)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    return parser


def _run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement, in this child process (`--worker NAME --mode MODE`)."""
    shape, bf16 = SHAPES[args.mode], args.mode == "gpu"
    if args.worker == "decode":
        return decode_worker(shape, bf16)
    if args.worker == "roofline":
        return roofline_worker(args.mode, args.out)
    if args.worker == "kernels":
        return kernels_worker(args.mode, bf16)
    if args.worker.startswith("fp8:"):
        return device_fp8.fp8_worker(args.worker.removeprefix("fp8:"), args.mode)
    return train_worker(args.worker, shape, bf16, profile_dir=args.out)


def _run_benchmarks(
    args: argparse.Namespace,
    phases: set[str],
    report: dict[str, Any],
    left: Callable[[float], float],
) -> None:
    """The training, launch, kernel and decode phases, each in its children; the report is
    rewritten after each."""
    mode = report["mode"]
    sides = ["hf", "ours", "ours-compile"] if mode == "gpu" else ["hf", "ours"]
    for side in sides if "train" in phases else []:
        cap = CHILD_CAP_S[mode] * (2 if side == "ours-compile" else 1)
        worker = ["--worker", side, "--mode", mode]
        worker += ["--out", str(args.out.resolve())] if args.profile else []
        report["train"][side] = _child(worker, left(cap))
        _write(args.out, report)
    if "launch" in phases:
        report["launch"] = run_launch(mode, left(CHILD_CAP_S[mode]))
        _write(args.out, report)
    if "kernels" in phases:
        worker = ["--worker", "kernels", "--mode", mode]
        report["kernels"] = _child(worker, left(CHILD_CAP_S[mode]))
        _write(args.out, report)
    if "decode" in phases:
        worker = ["--worker", "decode", "--mode", mode]
        report["decode"] = _child(worker, left(CHILD_CAP_S[mode]))
    else:
        report["decode"] = {"error": "not run: not in --phases"}


def _run_roofline(out: Path, report: dict[str, Any], left: Callable[[float], float]) -> None:
    mode = report["mode"]
    _write(out, report)
    work = out.resolve() / "roofline"
    worker = ["--worker", "roofline", "--mode", mode, "--out", str(work)]
    report["roofline"] = _child(worker, left(ROOFLINE_CAP_S[mode]))
    if "error" in report["roofline"] and (work / PARTIAL).is_file():  # cut short: keep
        measured = json.loads((work / PARTIAL).read_text())  # what it measured
        report["roofline"] = {**measured, "incomplete": report["roofline"]["error"]}


def _failed(report: dict[str, Any], phases: set[str]) -> bool:
    """Whether any phase that ran reported an error or a failed test."""
    failed = any("error" in row for row in report["train"].values())
    failed = failed or ("decode" in phases and "error" in report["decode"])
    tests = report.get("tests", {})
    failed = failed or "error" in tests or bool(tests.get("failed"))
    failed = failed or any(
        "error" in row for row in report.get("fp8", {}).get("sides", {}).values()
    )
    return failed or any(k in report.get("roofline", {}) for k in ("error", "incomplete"))


def main(argv: list[str] | None = None) -> int:
    """Run the check and write the report; returns 1 if any step failed."""
    parser = _parser()
    args = parser.parse_args(argv)
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    if not phases or phases - set(PHASES):
        parser.error(f"--phases takes names from {','.join(PHASES)}; got {args.phases!r}")
    if args.skip_tests:
        phases.discard("tests")
    if args.worker:
        print(json.dumps(_run_worker(args)))
        return 0
    if args.out is None:
        parser.error("--out DIR is required (where report.json and report.md go)")
    mode = "gpu" if device.current().type == "cuda" and not args.smoke else "smoke"
    deadline = time.monotonic() + (args.budget_s or BUDGET_S[mode])

    def left(cap: float) -> float:
        return max(0.0, min(cap, deadline - time.monotonic()))

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "mode": mode,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape": SHAPES[mode],
        "environment": environment(),
        "train": {},
        "decode": {"error": "not run yet"},
    }
    _write(args.out, report)
    # Each phase is capped, and the whole check stays within the budget; the report is rewritten
    # after every phase, so a check cut short still leaves what it measured.
    report["phases"] = [p for p in PHASES if p in phases]
    if "tests" in phases:
        report["tests"] = run_gpu_tests(args.out, mode, timeout=left(TESTS_CAP_S[mode]))
        _write(args.out, report)
    _run_benchmarks(args, phases, report, left)
    if "fp8" in phases:
        report["fp8"] = device_fp8.run_fp8(mode, left, _child, CHILD_CAP_S[mode])
    if "roofline" in phases:
        _run_roofline(args.out, report, left)
    page = _write(args.out, report)
    print(page)
    return 1 if _failed(report, phases) else 0


def _write(out: Path, report: dict[str, Any]) -> str:
    """Write report.json and report.md; returns the Markdown."""
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    page = markdown(report)
    (out / "report.md").write_text(page)
    return page


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
