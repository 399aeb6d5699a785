"""Converter: peak memory and time of a few-GB conversion vs transformers' load + save.

    python -m bench.bench_converter [--layers 12] [--hidden 2048] [--ffn 5504] [--vocab 32000]
        [--runs baseline,hf-hf,hf-native,native-hf,hf-megatron,hf-megatron-vpp]

Writes a random Llama checkpoint in HF layout (streamed, never whole in memory), then runs, each
in a fresh Python process whose peak RSS (`ru_maxrss`) is reported:

- baseline: `AutoModelForCausalLM.from_pretrained` + `save_pretrained` (HF → HF), the usual
  way to re-save a checkpoint: holds the whole model;
- ours HF → HF (same work as the baseline), HF → native (DCP), native → HF, HF → Megatron
  TP2 × PP4, and HF → Megatron TP2 × PP4 with virtual chunks of one layer (`hf-megatron-vpp`:
  a stage's last chunk arrives last, so a writer that buffered stages would hold most of the
  model; ours streams every shard to its file, see docs/converter.md).

`--runs` picks a subset (native-hf needs hf-native before it); without `baseline` no ratios are
printed.

Prints the model size, the largest unit (the embedding or a layer), each run's wall time and
peak RSS, and ours / baseline ratios (RSS < 1: ours leaner; time > 1: ours slower).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_RUNNER = """
import resource, sys, time, json
t0 = time.perf_counter()
kind, src, dst = sys.argv[1:4]
if kind == "baseline":
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst)
else:
    from services.converter.job import ConvertOptions, convert
    load, save, *variant = kind.split("-")
    extra = dict(target_tp=2, target_pp=4) if save == "megatron" else {}
    if variant == ["vpp"]:
        extra["layers_per_virtual_stage"] = 1
    convert(ConvertOptions(load, save, src, dst, **extra))
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


RUNS = ("baseline", "hf-hf", "hf-native", "native-hf", "hf-megatron", "hf-megatron-vpp")
"""Measurements, in the order they run."""


def _write_source(directory: Path, args: argparse.Namespace) -> tuple[int, int]:
    """A random HF checkpoint written unit by unit; returns (total bytes, largest unit bytes)."""
    import torch

    from models.registry import get_config
    from services.converter.hf_format import HFSink
    from services.converter.units import expected_names, expected_shapes, units

    config = get_config(
        "tiny-llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
    )
    shapes, names = expected_shapes(config), expected_names(config)
    sink = HFSink(directory, config, torch.float32, [])
    generator = torch.Generator().manual_seed(0)
    largest = total = 0
    for unit in units(config):
        tensors = {n: torch.randn(shapes[n], generator=generator) * 0.02 for n in names[unit]}
        size = sum(t.nbytes for t in tensors.values())
        largest, total = max(largest, size), total + size
        sink.write_unit(unit, tensors)
        del tensors
    sink.finish()
    return total, largest


def _run(kind: str, src: Path, dst: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, kind, str(src), str(dst)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_converter", description=__doc__)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"comma-separated subset of {','.join(RUNS)} (default: all)",
    )
    args = parser.parse_args(argv)
    runs = args.runs.split(",")
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    if "native-hf" in runs and "hf-native" not in runs:
        parser.error("--runs: native-hf reads hf-native's output; include hf-native")
    work = Path(tempfile.mkdtemp(prefix="bench_converter_", dir=args.workdir))
    try:
        hf = work / "hf"
        hf.mkdir()
        start = time.perf_counter()
        total, largest = _write_source(hf, args)
        print(
            f"model: llama hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}, vocab "
            f"{args.vocab}, fp32: {total / 2**30:.2f} GiB, largest unit {largest / 2**20:.0f} MiB "
            f"(written in {time.perf_counter() - start:.1f} s)"
        )
        baseline = None
        if "baseline" in runs:
            baseline = _run("baseline", hf, work / "baseline")
            shutil.rmtree(work / "baseline")
            print(
                f"{'baseline HF load+save':<24} {baseline['seconds']:7.1f} s  "
                f"peak RSS {baseline['peak_rss_mb']:7.0f} MiB"
            )
        for kind in (k for k in RUNS if k in runs and k != "baseline"):
            src = work / "hf-native" if kind == "native-hf" else hf
            result = _run(kind, src, work / kind)
            line = (
                f"{'ours ' + kind:<24} {result['seconds']:7.1f} s  peak RSS "
                f"{result['peak_rss_mb']:7.0f} MiB"
            )
            if baseline is not None:
                line += (
                    f"  time ratio {result['seconds'] / baseline['seconds']:.2f}  RSS ratio "
                    f"{result['peak_rss_mb'] / baseline['peak_rss_mb']:.2f}"
                )
            print(line)
            if kind != "hf-native":
                shutil.rmtree(work / kind)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
