"""One prepared accelerator check: gpu tests, a training and a decode benchmark, one report.

    python -m bench.device_check --out DIR [--smoke] [--skip-tests]
    make device-check OUT=DIR

Uses the torch already installed (a GPU machine's own image; nothing is downloaded). On a CUDA
device it runs, within about 8 minutes on one H100/H200:

1. the `gpu`-marked tests (every kernel backend against its reference, forward and backward,
   bf16/fp16 tolerances as written in each test), summarised from pytest's JUnit XML;
2. training: a Llama-family model of ~1.2B parameters (hidden 2048, 16 layers, GQA 16/8 heads,
   SwiGLU 5632, vocab 32000), bf16, sequence 2048, Meshline's Trainer eager and with
   `--compile` against HF `LlamaForCausalLM` + torch fused AdamW on the same shapes: tokens/s,
   TFLOP/s (6N + 12·L·H·Q·T per token), MFU against the device's peak (kernels.peak_flops);
3. decode: greedy, batch 1 and 8, 128 new tokens after a 128-token prompt, Meshline's engine
   against HF `generate` on the same weights (outputs checked identical first).

Each measurement runs in its own child process, so memory and compile caches do not carry
over. Without a GPU (or with --smoke) the same steps run on tiny shapes in seconds — what CI
runs (tests/bench/test_device_check.py) to keep the script working. Writes `report.json` and
`report.md` under --out and prints the Markdown.
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
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    "gpu": dict(
        hidden=2048, layers=16, heads=16, kv=8, ffn=5632, vocab=32000, seq=2048, mbs=2, gbs=16,
        warmup=2, steps=4, prompt=128, new=128,
    ),
    "smoke": dict(
        hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=256, seq=64, mbs=2, gbs=4,
        warmup=1, steps=2, prompt=8, new=8,
    ),
}  # fmt: skip
REPO = Path(__file__).resolve().parents[1]
# Time caps in seconds: the whole check, the gpu tests, and one benchmark child (twice that for
# the --compile side). The GPU budget keeps `make device-check` within 8 minutes.
BUDGET_S = {"gpu": 450.0, "smoke": 300.0}
TESTS_CAP_S = {"gpu": 150.0, "smoke": 120.0}
CHILD_CAP_S = {"gpu": 100.0, "smoke": 120.0}


def _train_flags(shape: dict[str, int], bf16: bool, compile_layers: bool) -> list[str]:
    flags = [
        "--model", "tiny-llama", "--num-layers", str(shape["layers"]),
        "--hidden-size", str(shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
        "--num-query-groups", str(shape["kv"]), "--ffn-hidden-size", str(shape["ffn"]),
        "--vocab-size", str(shape["vocab"]), "--max-position-embeddings", str(shape["seq"]),
        "--seq-length", str(shape["seq"]), "--micro-batch-size", str(shape["mbs"]),
        "--global-batch-size", str(shape["gbs"]),
        "--mock-data", "--train-iters", str(shape["warmup"] + shape["steps"]), "--lr", "1e-4",
        "--lr-decay-style", "constant", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--eval-interval", "0", "--optimizer", "fused_adam", "--log-interval", "1000",
    ]  # fmt: skip
    if bf16:
        flags.append("--bf16")
    if compile_layers:
        flags.append("--compile")
    return flags


def _hf_train_step(config: Any, bf16: bool) -> Any:
    """HF LlamaForCausalLM on the same batches, torch fused AdamW, same clipping."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kernels import device
    from models.hf_adapters import hf_config
    from services.trainer.batching import MicroBatchStream
    from services.trainer.setup import build_data, build_model_config

    (train, _), _, _ = build_data(config, dp_size=1)
    target = device.current().torch_device()
    hf = LlamaForCausalLM._from_config(
        LlamaConfig(**hf_config(build_model_config(config))), attn_implementation="sdpa"
    ).to(target)
    if bf16:
        hf = hf.to(torch.bfloat16)
    stream = MicroBatchStream(
        train, consumed_samples=0, micro_batch_size=config.batch.micro_batch_size,
        dp_rank=0, dp_size=1,
    )  # fmt: skip
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    no_decay = [p for p in hf.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
        fused=True,
    )

    n_micro = config.batch.global_batch_size // config.batch.micro_batch_size

    def step() -> None:
        for _ in range(n_micro):  # gradient accumulation, as the trainer does for the same sizes
            batch = {k: v.to(target) for k, v in stream.next().items()}
            out = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            loss = torch.nn.functional.cross_entropy(
                out.logits.flatten(0, 1).float(), batch["labels"].flatten()
            )
            (loss / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def train_worker(
    side: str, shape: dict[str, int], bf16: bool, profile_dir: Path | None = None
) -> dict[str, Any]:
    """One training side in this process: tokens/s, TFLOP/s, MFU, peak memory, compile time.

    With `profile_dir`, one more step runs under torch.profiler and its operator table (sorted by
    device time) is written to `profile-<side>.txt` there: where a step's time goes, from the
    same run that measured it.
    """
    import torch
    from torch._dynamo.utils import counters

    from kernels import device, peak_flops
    from models.accounting import flops_per_token
    from services.trainer.arguments import parse_args
    from services.trainer.loop import Trainer
    from services.trainer.setup import build_model_config

    torch.manual_seed(0)
    config = parse_args(_train_flags(shape, bf16, compile_layers=side == "ours-compile"))
    step = Trainer(config).train_step if side.startswith("ours") else _hf_train_step(config, bf16)
    start = time.perf_counter()
    for _ in range(shape["warmup"]):
        step()
    device.synchronize()
    warmup_s = time.perf_counter() - start
    device.reset_peak_memory_stats()
    begin = time.perf_counter()
    for _ in range(shape["steps"]):
        step()
    device.synchronize()
    elapsed = time.perf_counter() - begin
    tokens_per_s = shape["gbs"] * shape["seq"] * shape["steps"] / elapsed
    tflops = tokens_per_s * flops_per_token(build_model_config(config), shape["seq"]) / 1e12
    peak = peak_flops.peak_tflops()
    result = {
        "side": side,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak.tflops,
        "peak_memory_gib": device.memory_stats().peak / 2**30,
        "warmup_s": warmup_s,
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    if profile_dir is not None:
        _profile_step(step, profile_dir / f"profile-{side}.txt")
    return result


def _profile_step(step: Any, path: Path) -> None:
    """One step under torch.profiler; the operator table sorted by device (else CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    from kernels import device

    on_cuda = device.current().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    begin = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        device.synchronize()
    wall = time.perf_counter() - begin
    key = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    path.write_text(f"one profiled step: {wall * 1e3:.1f} ms wall (profiler on)\n{table}\n")


def decode_worker(shape: dict[str, int], bf16: bool) -> dict[str, Any]:
    """Greedy decode, batch 1 and 8: Meshline's engine vs HF generate on the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.engine import Engine, EngineConfig
    from engine.sampling import SamplingConfig
    from engine.tokens import TokenizerInfo
    from kernels import device
    from models import build_model
    from models.hf_adapters import from_hf, hf_config
    from models.registry import get_config

    dtype = torch.bfloat16 if bf16 else torch.float32
    target = device.current().torch_device()
    config = get_config(
        "tiny-llama-gqa", vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        num_layers=shape["layers"], num_attention_heads=shape["heads"], num_kv_heads=shape["kv"],
        ffn_hidden_size=shape["ffn"], max_position_embeddings=shape["prompt"] + shape["new"] + 8,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM._from_config(LlamaConfig(**hf_config(config)), attn_implementation="sdpa")
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.02)
    hf = hf.to(device=target).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, config.vocab_size, (8, shape["prompt"]), generator=gen).tolist()
    engine: Engine | None = None

    def load(dtype_: torch.dtype) -> None:
        nonlocal hf, engine
        hf = hf.to(dtype=dtype_)
        ours = build_model(config, device=target, dtype=dtype_).eval()
        ours.load_state_dict(from_hf(hf.state_dict(), config))
        engine = Engine(ours, TokenizerInfo(config.vocab_size), EngineConfig(max_batch_rows=8))

    def hf_run(batch: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(batch, device=target)
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=shape["new"],
                do_sample=False, eos_token_id=None, pad_token_id=0,
                top_k=None, top_p=None, temperature=None,
            )  # fmt: skip
        return out[:, shape["prompt"] :].tolist()

    def ours_run(batch: list[list[int]]) -> list[list[int]]:
        assert engine is not None
        settings = [SamplingConfig(max_new_tokens=shape["new"]) for _ in batch]
        return [r[0].token_ids for r in engine.generate(batch, settings)]

    # Parity in fp32 with TF32 off (random weights give near-flat logits, where bf16 rounding
    # alone flips an argmax); then the timed runs in the benchmark dtype, whose greedy tokens are
    # reported as the length of the prefix shared with HF.
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    load(torch.float32)
    result: dict[str, Any] = {"identical_greedy": ours_run(prompts[:2]) == hf_run(prompts[:2])}
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    load(dtype)
    if dtype != torch.float32:
        mine, theirs = ours_run(prompts[:1])[0], hf_run(prompts[:1])[0]
        shared = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), len(mine)
        )
        result[f"shared_prefix_{str(dtype).removeprefix('torch.')}"] = shared
    for rows in (1, 8):
        batch = prompts[:rows]
        times: dict[str, list[float]] = {"hf": [], "ours": []}
        for _ in range(3):
            for name, fn in (("hf", hf_run), ("ours", ours_run)):
                device.synchronize()
                begin = time.perf_counter()
                fn(batch)
                device.synchronize()
                times[name].append(time.perf_counter() - begin)
        tokens = rows * shape["new"]
        hf_tps, ours_tps = (tokens / min(times[name]) for name in ("hf", "ours"))
        result[f"batch{rows}"] = {"hf_tokens_per_s": hf_tps, "ours_tokens_per_s": ours_tps}
    return result


KERNEL_SHAPES = {
    "gpu": dict(batch=2, seq=2048, heads=16, kv_heads=8, head_dim=128, ffn=5632, vocab=32000),
    "smoke": dict(batch=1, seq=64, heads=4, kv_heads=2, head_dim=16, ffn=64, vocab=256),
}


def kernels_worker(mode: str, bf16: bool) -> dict[str, Any]:
    """Each kernel's default backend on this device (on CUDA: the torch.compile-generated ones)
    against HF's / torch's eager equivalent, forward+backward, via bench.bench_kernels."""
    import torch

    from bench import bench_kernels
    from kernels import device

    torch.set_default_device(device.current().torch_device())
    torch.manual_seed(0)
    args = argparse.Namespace(**KERNEL_SHAPES[mode])
    dtype = torch.bfloat16 if bf16 else torch.float32
    table = bench_kernels.Table(
        min_run_time=0.05 if mode == "gpu" else 0.005, rounds=2 if mode == "gpu" else 1
    )
    bench_kernels.bench_norm_rotary_activation(table, args, dtype)
    bench_kernels.bench_attention(table, args, dtype)
    bench_kernels.bench_cross_entropy(table, args, dtype)
    rows = [
        {"op": op, "impl": impl, "ms": t * 1e3, "baseline": base, "speedup": speedup}
        for op, impl, t, base, speedup in table.rows
    ]
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows}


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
    flags = [f if f != "1000" else "1" for f in _train_flags(shape, mode == "gpu", False)]
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
    import torch

    from kernels import device, peak_flops

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
    tests = report.get("tests", {})
    if "error" in tests:
        lines.append(f"Tests: {tests['error']}")
    elif tests:
        lines.append(
            f"Tests: {tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
            f"{tests['skipped']} skipped"
            + (f" — failed: {tests['failed']}" if tests["failed"] else "")
        )
    lines += ["", "| training | tokens/s | TFLOP/s | MFU | peak GiB | warm-up s | vs HF |"]
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
    decode = report["decode"]
    lines += [
        "",
        "| decode (greedy) | HF tokens/s | Meshline tokens/s | ratio |",
        "|---|---|---|---|",
    ]
    if "error" in decode:
        lines.append(f"| {decode['error']} | | | |")
    else:
        for rows in (1, 8):
            row = decode[f"batch{rows}"]
            lines.append(
                f"| batch {rows} | {row['hf_tokens_per_s']:,.0f} | {row['ours_tokens_per_s']:,.0f} "
                f"| {row['ours_tokens_per_s'] / row['hf_tokens_per_s']:.2f}x |"
            )
        lines.append(f"\ngreedy tokens identical to HF in fp32: {decode['identical_greedy']}")
        for key, value in decode.items():
            if key.startswith("shared_prefix_"):
                lines.append(
                    f"{key.removeprefix('shared_prefix_')}: first {value} of {report['shape']['new']}"
                    " greedy tokens as HF's"
                )
    kernels = report.get("kernels", {})
    if "error" in kernels:
        lines += ["", f"Kernels: {kernels['error']}"]
    elif kernels:
        lines += [
            "",
            f"| kernel ({kernels['dtype']}, fwd+bwd) | implementation | ms | vs baseline |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {row['op']} | {row['impl']} | {row['ms']:.3f} | {row['speedup']:.2f}x "
            f"({row['baseline']}) |"
            for row in kernels["rows"]
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the check and write the report; returns 1 if any step failed."""
    parser = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__)
    parser.add_argument("--out", type=Path, help="folder for report.json and report.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes even on a GPU")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
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
    args = parser.parse_args(argv)
    if args.worker:
        shape, bf16 = SHAPES[args.mode], args.mode == "gpu"
        if args.worker == "decode":
            result = decode_worker(shape, bf16)
        elif args.worker == "kernels":
            result = kernels_worker(args.mode, bf16)
        else:
            result = train_worker(args.worker, shape, bf16, profile_dir=args.out)
        print(json.dumps(result))
        return 0
    if args.out is None:
        parser.error("--out DIR is required (where report.json and report.md go)")
    from kernels import device

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
    if not args.skip_tests:
        report["tests"] = run_gpu_tests(args.out, mode, timeout=left(TESTS_CAP_S[mode]))
        _write(args.out, report)
    sides = ["hf", "ours", "ours-compile"] if mode == "gpu" else ["hf", "ours"]
    for side in sides:
        cap = CHILD_CAP_S[mode] * (2 if side == "ours-compile" else 1)
        worker = ["--worker", side, "--mode", mode]
        worker += ["--out", str(args.out.resolve())] if args.profile else []
        report["train"][side] = _child(worker, left(cap))
        _write(args.out, report)
    report["launch"] = run_launch(mode, left(CHILD_CAP_S[mode]))
    _write(args.out, report)
    report["kernels"] = _child(["--worker", "kernels", "--mode", mode], left(CHILD_CAP_S[mode]))
    _write(args.out, report)
    report["decode"] = _child(["--worker", "decode", "--mode", mode], left(CHILD_CAP_S[mode]))
    page = _write(args.out, report)
    print(page)
    failed = any("error" in row for row in report["train"].values()) or "error" in report["decode"]
    tests = report.get("tests", {})
    failed = failed or "error" in tests or bool(tests.get("failed"))
    return 1 if failed else 0


def _write(out: Path, report: dict[str, Any]) -> str:
    """Write report.json and report.md; returns the Markdown."""
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    page = markdown(report)
    (out / "report.md").write_text(page)
    return page


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
