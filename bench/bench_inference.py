"""Inference engine vs HF `generate` on the same model, weights and settings, in the same run.

    python -m bench.bench_inference [--quick] [--threads 2] [--dtype fp32|bf16] [--stat min]
                                    [--cpu-linear dense|packed|packed+gemv] [--clock cpu]
                                    [--compile-decode]

The model is a random Llama (GQA) built in HF and converted through the adapters, so both sides
compute the same function (greedy outputs are checked token-identical before timing). Rows:

- decode tokens/s at batch 1 and batch 8: `max_new_tokens` new tokens per sequence after a
  prompt, EOS disabled, divided by the wall time of the whole call (prefill included on both).
- time to first token: one prompt, `max_new_tokens=1`.
- beam-4 tokens/s: `num_beams=4`, new tokens of the returned sequence over wall time.

Each row alternates HF and ours for `--rounds` rounds and reports medians (`--stat min`: the
best round of each, steadier when other jobs share the cores), so load drifting on a shared
machine hits both. `--clock cpu` times the process's CPU time instead of wall time: with
`--threads 1` that is the work done, whatever else runs on the machine (preemption is not
counted). ratio = HF time / our time (> 1: the engine is faster). `--compile-decode` compiles
the engine's decode step (EngineConfig.compile_decode); the compile time, taken by the untimed
warm-up calls, is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import CPU_LINEAR, EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from models import build_model
from models.config import ModelConfig
from models.hf_adapters import from_hf, hf_config
from models.registry import get_config
from models.transformer import CausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def build_pair(quick: bool, dtype: torch.dtype) -> tuple[LlamaForCausalLM, CausalLM, ModelConfig]:
    """(HF model, our model) with the same random weights."""
    size = (
        dict(
            hidden_size=128,
            num_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=384,
        )
        if quick
        else dict(
            hidden_size=512,
            num_layers=8,
            num_attention_heads=8,
            num_kv_heads=4,
            ffn_hidden_size=1408,
        )
    )
    config = get_config("tiny-llama-gqa", vocab_size=4096, max_position_embeddings=512, **size)
    torch.manual_seed(0)
    hf = LlamaForCausalLM._from_config(LlamaConfig(**hf_config(config)), attn_implementation="sdpa")
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.1)
    hf = hf.to(dtype).eval()
    ours = build_model(config, device="cpu", dtype=dtype).eval()
    ours.load_state_dict(from_hf(hf.state_dict(), config))
    return hf, ours, config


def _timed_pair(
    baseline: Callable[[], object],
    ours: Callable[[], object],
    rounds: int,
    stat: str,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    baseline()
    ours()
    times_b: list[float] = []
    times_o: list[float] = []
    for _ in range(rounds):
        for fn, times in ((baseline, times_b), (ours, times_o)):
            start = clock()
            fn()
            times.append(clock() - start)
    pick = min if stat == "min" else statistics.median
    return pick(times_b), pick(times_o)


def _hf_call(hf, prompts: list[list[int]], **settings) -> Callable[[], torch.Tensor]:
    ids = torch.tensor(prompts)
    kwargs = dict(
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        top_k=None,
        top_p=None,
        temperature=None,
        attention_mask=torch.ones_like(ids),
        **settings,
    )

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(ids, **kwargs)

    return run


def _ours_call(engine: Engine, prompts: list[list[int]], **settings) -> Callable[[], object]:
    configs = [SamplingConfig(**settings) for _ in prompts]
    return lambda: engine.generate(prompts, configs)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a table; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, fewer tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--cpu-linear", choices=CPU_LINEAR, default=EngineConfig.cpu_linear)
    parser.add_argument("--clock", choices=CLOCKS, default="wall")
    parser.add_argument("--compile-decode", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    hf, ours, config = build_pair(args.quick, dtype)
    engine_config = EngineConfig(
        max_batch_rows=16, cpu_linear=args.cpu_linear, compile_decode=args.compile_decode
    )
    engine = Engine(ours, TokenizerInfo(config.vocab_size), engine_config)
    rounds = args.rounds or (3 if args.quick else 5)
    new = 32 if args.quick else 128
    prompt_len = 32 if args.quick else 128
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, config.vocab_size, (8, prompt_len), generator=gen).tolist()

    [[check]] = engine.generate([prompts[0]], [SamplingConfig(max_new_tokens=16)])
    reference = _hf_call(hf, prompts[:1], max_new_tokens=16)()[0, prompt_len:].tolist()
    print(f"greedy outputs identical to HF: {check.token_ids == reference}")
    if args.compile_decode:
        # Every batch shape the rows below decode at, so no timed call compiles.
        start, cpu_start = time.perf_counter(), time.process_time()
        for rows in (1, 4, 8):
            engine.generate(prompts[:rows], [SamplingConfig(max_new_tokens=4)] * rows)
        print(
            f"compile (batch shapes 1, 4, 8): {time.perf_counter() - start:.1f} s wall, "
            f"{time.process_time() - cpu_start:.1f} s CPU"
        )

    print(
        f"model: llama-gqa hidden={config.hidden_size} layers={config.num_layers} "
        f"heads={config.num_attention_heads}/{config.kv_heads} vocab={config.vocab_size} "
        f"dtype={args.dtype} threads={args.threads} prompt={prompt_len} new={new} rounds={rounds} "
        f"stat={args.stat} clock={args.clock} cpu_linear={args.cpu_linear} "
        f"compile_decode={args.compile_decode}"
    )
    header = f"{'row':<22}{'HF generate':>16}{'Meshline':>16}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    rows = [
        ("decode batch 1", prompts[:1], dict(max_new_tokens=new), new, "tok/s"),
        ("decode batch 8", prompts, dict(max_new_tokens=new), 8 * new, "tok/s"),
        ("time to first token", prompts[:1], dict(max_new_tokens=1), None, "ms"),
        ("beam-4", prompts[:1], dict(max_new_tokens=new, num_beams=4), new, "tok/s"),
    ]
    for name, batch, settings, tokens, unit in rows:
        t_hf, t_ours = _timed_pair(
            _hf_call(hf, batch, **settings),
            _ours_call(engine, batch, **settings),
            rounds,
            args.stat,
            CLOCKS[args.clock],
        )
        if unit == "ms":
            shown = (f"{t_hf * 1e3:.1f} ms", f"{t_ours * 1e3:.1f} ms")
        else:
            assert tokens is not None
            shown = (f"{tokens / t_hf:.0f} tok/s", f"{tokens / t_ours:.0f} tok/s")
        print(f"{name:<22}{shown[0]:>16}{shown[1]:>16}{t_hf / t_ours:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
