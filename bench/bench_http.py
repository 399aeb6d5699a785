"""OpenAI HTTP front vs gRPC on one server: overhead per token, and a 32-stream HTTP load test.

    python -m bench.bench_http [--quick] [--tokens 64] [--clients 32] [--duration 60]

Builds the small random Llama checkpoint of bench/load_inference.py and starts one
`python -m services.inference serve --load DIR --port 0 --http-port 0` (one engine, both
protocols). Overhead: B = 1 and 8 concurrent greedy requests of `--tokens` new tokens each, the
same prompts through gRPC (Generate, GenerateStream) and HTTP (/v1/completions, plain and
`stream: true`); reported as ms per generated token (wall time / tokens) and HTTP / gRPC. The
baseline (gRPC) runs in the same process against the same server, alternating, best of 3.
Load: `--clients` asyncio HTTP clients for `--duration` seconds, each looping over streamed and
plain completions (every fifth stream closed after three chunks), server RSS sampled each second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import grpc
import psutil

from bench.load_inference import write_checkpoint
from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0
MODEL = "bench"


def start_server(directory: Path) -> tuple[subprocess.Popen, int, int]:
    """The server process, its gRPC port and its HTTP port (parsed from the log)."""
    command = [sys.executable, "-m", "services.inference", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--http-port", "0", "--load", str(directory)]
    command += ["--served-model-name", MODEL, "--max-concurrent-rpcs", "256"]
    command += ["--http-max-concurrent-requests", "256"]
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    ports: dict[str, int] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in server.stderr:
        if match := re.search(r"HTTP API on http://\S+:(\d+)/v1", line):
            ports["http"] = int(match.group(1))
        if match := re.search(r"serving .* on \S+:(\d+)", line):
            ports["grpc"] = int(match.group(1))
        if len(ports) == 2:
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, ports["grpc"], ports["http"]
        if time.monotonic() > deadline:
            break
    server.kill()
    raise RuntimeError("the inference server did not start")


def prompts(batch: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(4, vocab) for _ in range(16)] for _ in range(batch)]


async def grpc_run(port: int, batch: list[list[int]], tokens: int, stream: bool) -> int:
    """Generated tokens of `batch` concurrent gRPC requests."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one(ids: list[int]) -> int:
            params = pb.SamplingParams(max_new_tokens=tokens)
            request = pb.GenerateRequest(prompt_token_ids=ids, params=params)
            if stream:
                return sum([len(m.token_ids) async for m in stub.GenerateStream(request)])
            response = await stub.Generate(request)
            return len(response.sequences[0].token_ids)

        return sum(await asyncio.gather(*(one(ids) for ids in batch)))


async def http_run(port: int, batch: list[list[int]], tokens: int, stream: bool) -> int:
    """Generated tokens of `batch` concurrent HTTP completions."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession() as session:

        async def one(ids: list[int]) -> int:
            body = {"model": MODEL, "prompt": ids, "max_tokens": tokens, "temperature": 0}
            if not stream:
                async with session.post(url, json=body) as response:
                    return (await response.json())["usage"]["completion_tokens"]
            body["stream"] = True
            count = 0
            async with session.post(url, json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        count += 1
            return count

        return sum(await asyncio.gather(*(one(ids) for ids in batch)))


async def overhead(grpc_port: int, http_port: int, vocab: int, tokens: int, repeats: int) -> None:
    print(f"{'batch':>5} {'mode':>6} {'grpc ms/tok':>12} {'http ms/tok':>12} {'http/grpc':>9}")
    for size in (1, 8):
        batch = prompts(size, vocab)
        for stream in (False, True):
            best = {"grpc": float("inf"), "http": float("inf")}
            for _ in range(repeats):
                for name, run, port in (
                    ("grpc", grpc_run, grpc_port),
                    ("http", http_run, http_port),
                ):
                    start = time.perf_counter()
                    produced = await run(port, batch, tokens, stream)
                    assert produced == size * tokens, (name, produced)
                    best[name] = min(best[name], (time.perf_counter() - start) / produced)
            mode = "stream" if stream else "unary"
            print(
                f"{size:>5} {mode:>6} {best['grpc'] * 1e3:>12.3f} {best['http'] * 1e3:>12.3f} "
                f"{best['http'] / best['grpc']:>9.3f}"
            )


async def load_client(
    index: int, port: int, vocab: int, stop_at: float, stats: Counter, errors: Counter
) -> None:
    rng = random.Random(index)
    url = f"http://127.0.0.1:{port}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        calls = 0
        while time.monotonic() < stop_at:
            calls += 1
            ids = [rng.randrange(4, vocab) for _ in range(rng.randint(4, 48))]
            body: dict = {"model": MODEL, "prompt": ids, "max_tokens": rng.randint(8, 32)}
            body["temperature"] = 0 if rng.random() < 0.5 else 0.8
            stream = calls % 2 == 0
            body["stream"] = stream
            try:
                async with session.post(url, json=body) as response:
                    if response.status != 200:
                        errors[str(response.status)] += 1
                        continue
                    if not stream:
                        stats["tokens"] += (await response.json())["usage"]["completion_tokens"]
                    else:
                        chunks = 0
                        async for line in response.content:
                            if line.startswith(b"data: {"):
                                chunk = json.loads(line[6:])
                                if "error" in chunk:
                                    errors["stream-error"] += 1
                                    break
                                chunks += 1
                                stats["tokens"] += 1
                                if calls % 5 == 0 and chunks == 3:
                                    stats["cancelled"] += 1
                                    break
                stats["calls"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors[type(exc).__name__] += 1


async def sample_rss(pid: int, stop_at: float, samples: list[float]) -> None:
    process = psutil.Process(pid)
    while time.monotonic() < stop_at:
        samples.append(process.memory_info().rss / 2**20)
        await asyncio.sleep(1.0)


async def load(port: int, pid: int, vocab: int, clients: int, duration: float) -> int:
    stats: Counter = Counter()
    errors: Counter = Counter()
    samples: list[float] = []
    stop_at = time.monotonic() + duration
    start = time.monotonic()
    await asyncio.gather(
        sample_rss(pid, stop_at, samples),
        *(load_client(i, port, vocab, stop_at, stats, errors) for i in range(clients)),
    )
    elapsed = time.monotonic() - start
    quarter = samples[len(samples) // 4]
    print(f"load: clients={clients} duration={duration:.0f}s elapsed={elapsed:.1f}s")
    print(
        f"calls={stats['calls']} tokens={stats['tokens']} "
        f"tokens/s={stats['tokens'] / elapsed:.1f} cancelled={stats['cancelled']} "
        f"errors={sum(errors.values())} {dict(errors)}"
    )
    print(
        f"server RSS MiB: start {samples[0]:.1f}, 25% {quarter:.1f}, end {samples[-1]:.1f} "
        f"(growth after warm-up {samples[-1] - quarter:+.1f})"
    )
    return sum(errors.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_http", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="16 tokens, 1 repeat, 15 s load")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="best of N per configuration")
    parser.add_argument("--clients", type=int, default=32, help="load-test clients")
    parser.add_argument("--duration", type=float, default=60.0, help="load-test seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.duration = 16, 1, 15.0
    with tempfile.TemporaryDirectory() as tmp:
        vocab = write_checkpoint(Path(tmp) / "ckpt")
        server, grpc_port, http_port = start_server(Path(tmp) / "ckpt")
        try:
            asyncio.run(overhead(grpc_port, http_port, vocab, args.tokens, args.repeats))
            errors = asyncio.run(load(http_port, server.pid, vocab, args.clients, args.duration))
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
