"""GRPO rollouts: the colocated engine vs trl's own generation path (transformers `generate`).

    python -m bench.bench_rollouts [--quick] [--threads 2] [--prompts 8] [--generations 8]
                                   [--new 64] [--rounds 3] [--prompt-len 32]
                                   [--stat median|min] [--profile N]

The same random Llama (bench.bench_inference.build_pair: HF and Meshline with equal weights),
the same prompts and group size, sampling as trl's GRPO defaults (temperature 1, top-p 1, no
top-k), EOS disabled so every completion has `--new` tokens. trl without vLLM repeats each
prompt `num_generations` times and calls `generate` on the batch (do_sample); Meshline's path
is `engine.colocated.ColocatedEngine.generate` over the module being trained (dense weights
read in place by the C decode step, each group's prompt prefilled once, the KV cache allocated
for the call and freed after, as a training step sees it). Rounds
alternate the two; ratio = HF time / ours (> 1: the engine is faster). Rollout tokens/s counts
generated tokens (prompts x generations x new) over the wall time of the whole call.
`--profile N` then runs each path once more under cProfile and prints its N functions with the
most own time (where a rollout's time goes: the C decode step, the prefill, sampling, Python).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch

from bench.bench_inference import build_pair
from engine.colocated import ColocatedEngine, RolloutSampling
from engine.config import EngineConfig
from engine.native_step import NativeStep
from engine.tokens import TokenizerInfo


def _alternated(
    baseline: Callable[[], object], ours: Callable[[], object], rounds: int, stat: str
) -> tuple[float, float]:
    """(baseline, ours) wall time: the median (or min) of `rounds` alternated calls each."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, bucket in zip((baseline, ours), times, strict=True):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    pick = min if stat == "min" else statistics.median
    return pick(times[0]), pick(times[1])


def _decode_path(colocated: ColocatedEngine) -> str:
    """Which decode step the colocated engine runs, and for how many rows."""
    step = colocated.engine.runner.decode_step
    if isinstance(step, NativeStep):
        return f"C step (<= {step.max_rows} rows)"
    return "module forward" if step is None else "lean step"


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print one line per setting; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, fewer tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="top-N own-time profile"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf, ours, config = build_pair(args.quick, torch.float32)
    prompts_n = args.prompts or (4 if args.quick else 8)
    new = args.new or (16 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 3)
    group = args.generations
    prompt_len = args.prompt_len
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, config.vocab_size, (prompts_n, prompt_len), generator=gen).tolist()
    colocated = ColocatedEngine(
        ours,
        TokenizerInfo(config.vocab_size),
        EngineConfig(cpu_linear="dense", max_batch_rows=prompts_n * group),
        RolloutSampling(max_completion_length=new, temperature=1.0, top_p=1.0),
    )
    seeds = list(range(prompts_n))
    ids = torch.tensor(prompts).repeat_interleave(group, dim=0)

    def trl_path() -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
            )

    def engine_path() -> object:
        return colocated.generate(ours, prompts, seeds, group)

    out = engine_path()
    assert all(len(s.token_ids) == new for g in out for s in g)
    assert trl_path().shape == (prompts_n * group, prompt_len + new)
    start = time.perf_counter()
    hf_time, our_time = _alternated(trl_path, engine_path, rounds, args.stat)
    tokens = prompts_n * group * new
    print(
        f"rollouts hidden {config.hidden_size} x {config.num_layers} layers, {prompts_n} prompts "
        f"x {group} generations x {new} new tokens (prompt {prompt_len}), {args.threads} "
        f"threads, {args.stat} of {rounds} rounds: trl/transformers generate "
        f"{tokens / hf_time:.1f} tok/s, colocated engine {tokens / our_time:.1f} tok/s, "
        f"ratio {hf_time / our_time:.2f}x; decode path {_decode_path(colocated)}; weight "
        f"bytes copied {colocated.weight_bytes_copied()} "
        f"({time.perf_counter() - start:.0f} s)"
    )
    for name, fn in (("trl/transformers generate", trl_path), ("colocated engine", engine_path)):
        if args.profile > 0:
            print(f"profile of one {name} call:\n{_profile(fn, args.profile)}")
    return 0


def _profile(fn: Callable[[], object], top: int) -> str:
    """The `top` functions of one `fn()` call by own time (cProfile's table)."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


if __name__ == "__main__":
    raise SystemExit(main())
