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
  model; ours streams every shard to its file, see docs/converter.md);
- DeepSpeed: the same weights as a ZeRO-3 checkpoint of 4 DP ranks; `deepspeed-whole`
  consolidates the whole fp32 state dict in memory and saves it (what DeepSpeed's zero_to_fp32.py
  does; DeepSpeed itself is not installed, so this is our reader's `full_state_dict`), vs
  `deepspeed-hf`, ours unit by unit.

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
from typing import Any

_RUNNER = """
import resource, sys, time, json
t0 = time.perf_counter()
kind, src, dst = sys.argv[1:4]
if kind == "baseline":
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst)
elif kind == "deepspeed-whole":
    import os
    from pathlib import Path
    from safetensors.torch import save_file
    from checkpoints.deepspeed_format import DeepSpeedSource
    state = DeepSpeedSource(Path(src), None).full_state_dict()
    os.makedirs(dst)
    save_file(state, os.path.join(dst, "model.safetensors"))
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


RUNS = (
    "baseline",
    "hf-hf",
    "hf-native",
    "native-hf",
    "hf-megatron",
    "hf-megatron-vpp",
    "deepspeed-whole",
    "deepspeed-hf",
)
"""Measurements, in the order they run."""


def _in_child(function: str, *args: object) -> Any:
    """Runs one of this module's writers in a fresh process and returns its result.

    Measured runs are children of this process, and Linux carries a parent's peak RSS into a
    child's `ru_maxrss` across the fork + exec that starts it; so this process must stay small,
    and whatever builds the sources (the DeepSpeed copy holds the model) runs elsewhere."""
    code = (
        "import json, sys; from bench import bench_converter as b; "
        f"print(json.dumps(b.{function}(*json.loads(sys.argv[1]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{function} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write_source(
    directory: str, layers: int, hidden: int, ffn: int, vocab: int
) -> tuple[int, int]:
    """A random HF checkpoint written unit by unit; returns (total bytes, largest unit bytes)."""
    import torch

    # only in the writer's child (_in_child): this process must stay small
    from checkpoints.hf_format import HFSink
    from checkpoints.units import expected_names, expected_shapes, units
    from models.registry import get_config

    config = get_config(
        "tiny-llama",
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=hidden // 128,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    shapes, names = expected_shapes(config), expected_names(config)
    sink = HFSink(Path(directory), config, torch.float32, [])
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


def _write_deepspeed(hf_dir: str, ds_dir: str, world: int = 4) -> None:
    """The HF checkpoint's weights as a DeepSpeed ZeRO-3 checkpoint of `world` DP ranks (the
    layout of checkpoints/deepspeed_format.py): each parameter padded to a multiple of
    `world` and cut into one piece per rank, the pieces in one flat fp32 group per rank."""
    import math
    from collections import OrderedDict

    import torch
    from safetensors import safe_open

    hf, directory = Path(hf_dir), Path(ds_dir)
    files = sorted(hf.glob("*.safetensors"))
    shapes: OrderedDict[str, torch.Size] = OrderedDict()
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[name] = torch.Size(f.get_slice(name).get_shape())
    parts = {n: math.ceil(s.numel() / world) for n, s in shapes.items()}
    flat = [torch.zeros(sum(parts.values())) for _ in range(world)]
    offset = 0
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name).reshape(-1)
                part = parts[name]
                for rank in range(world):
                    piece = tensor[rank * part : (rank + 1) * part]
                    flat[rank][offset : offset + piece.numel()] = piece
                offset += parts[name]
                del tensor
    tag = directory / "global_step1"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("global_step1")
    shutil.copy2(hf / "config.json", directory / "config.json")
    for rank in range(world):
        model_states = {
            "module": {},
            "buffer_names": [],
            "param_shapes": [shapes],
            "shared_params": {},
            "ds_version": "0.19.8",
        }
        torch.save(model_states, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        optim = {"zero_stage": 3, "partition_count": world, "fp32_flat_groups": [flat[rank]]}
        torch.save(
            {"optimizer_state_dict": optim}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        )
        flat[rank] = torch.empty(0)


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
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a 2-layer, 256-wide model (what `python -m bench` runs)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.ffn, args.vocab = 2, 256, 688, 1024
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
        total, largest = _in_child(
            "_write_source", str(hf), args.layers, args.hidden, args.ffn, args.vocab
        )
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
        if any(k.startswith("deepspeed") for k in runs):
            start = time.perf_counter()
            _in_child("_write_deepspeed", str(hf), str(work / "deepspeed"))
            print(f"DeepSpeed ZeRO-3 DP4 copy written in {time.perf_counter() - start:.1f} s")
        for kind in (k for k in RUNS if k in runs and k != "baseline"):
            src = work / "hf-native" if kind == "native-hf" else hf
            if kind.startswith("deepspeed"):
                src = work / "deepspeed"
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
