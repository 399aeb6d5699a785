"""Load test: 32 concurrent streaming clients against a localhost inference server.

    python -m bench.load_inference [--clients 32] [--duration 60] [--quick] [--hostile 9]

Builds a small random Llama checkpoint (HF format) in a temporary directory, starts
`python -m services.inference serve --load DIR --port 0` as a child process, and runs `--clients`
asyncio clients for `--duration` seconds. Each client loops over GenerateStream calls with random
prompts and lengths (greedy, sampled and beam requests); every fifth call cancels after three
messages. The server's RSS is sampled every second. The report gives calls, streamed tokens,
errors by status code, cancellations, and RSS at start / 25% / end with the growth after warm-up.
The script stops the server and itself after the duration (plus a bounded drain).
`--hostile N` also sends N hostile Generate calls (seed 2**64 - 1, sampling, two sequences: the
request that used to overflow inside the shared engine step) a third of the way in; their
statuses are reported apart, and the clients' errors must stay 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0


def write_checkpoint(directory: Path) -> int:
    """A random Llama-GQA HF checkpoint; returns its vocabulary size."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    # after __main__ sets OMP_NUM_THREADS: torch reads it when it loads
    from models.hf_adapters import hf_config
    from models.registry import get_config

    config = get_config("tiny-llama-gqa", vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = LlamaForCausalLM._from_config(LlamaConfig(**hf_config(config)))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()},
        str(directory / "model.safetensors"),
    )
    (directory / "config.json").write_text(hf.config.to_json_string())
    return config.vocab_size


def start_server(directory: Path) -> tuple[subprocess.Popen, int]:
    """The server process and the port it reported."""
    command = [sys.executable, "-m", "services.inference", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--load", str(directory), "--max-concurrent-rpcs", "256"]
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in server.stderr:
        match = re.search(r"serving .* on \S+:(\d+)", line)
        if match:
            # Keep reading the log so a chatty server never blocks on a full pipe.
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, int(match.group(1))
        if time.monotonic() > deadline:
            break
    server.kill()
    raise RuntimeError("the inference server did not start")


def _request(rng: random.Random, vocab: int) -> pb.GenerateRequest:
    kind = rng.random()
    params = pb.SamplingParams(max_new_tokens=rng.randint(8, 32))
    if kind < 0.4:
        params.do_sample = True
        params.top_k = 20
        params.seed = rng.randrange(1 << 30)
    elif kind < 0.5:
        params.num_beams = 2
    ids = [rng.randrange(4, vocab) for _ in range(rng.randint(4, 48))]
    return pb.GenerateRequest(prompt_token_ids=ids, params=params)


async def client(
    index: int, port: int, vocab: int, stop_at: float, stats: Counter, errors: Counter
) -> None:
    """One client's loop of streaming calls until `stop_at`."""
    rng = random.Random(index)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        calls = 0
        while time.monotonic() < stop_at:
            calls += 1
            cancel = calls % 5 == 0
            call = stub.GenerateStream(_request(rng, vocab), timeout=120)
            try:
                messages = 0
                async for message in call:
                    messages += 1
                    stats["tokens"] += len(message.token_ids)
                    if cancel and messages == 3:
                        call.cancel()
                        stats["cancelled"] += 1
                        break
                stats["calls"] += 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    errors[exc.code().name] += 1


async def hostile_calls(port: int, vocab: int, count: int, delay: float, codes: Counter) -> None:
    """`count` concurrent overflow-seed Generate calls after `delay` seconds; their statuses."""
    await asyncio.sleep(delay)
    params = pb.SamplingParams(
        max_new_tokens=8, do_sample=True, seed=2**64 - 1, num_return_sequences=2
    )
    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7 % vocab], params=params)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one() -> None:
            try:
                await stub.Generate(request, timeout=60)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] += 1

        await asyncio.gather(*(one() for _ in range(count)))


async def sample_rss(pid: int, stop_at: float, samples: list[tuple[float, float]]) -> None:
    """RSS of the server process (MiB) once per second."""
    process = psutil.Process(pid)
    start = time.monotonic()
    while time.monotonic() < stop_at:
        samples.append((time.monotonic() - start, process.memory_info().rss / 2**20))
        await asyncio.sleep(1.0)


async def run_load(
    port: int, pid: int, vocab: int, clients: int, duration: float, hostile: int = 0
) -> int:
    """Run the clients (and `hostile` bad calls) and print the report; returns the clients'
    number of errors."""
    stats: Counter = Counter()
    errors: Counter = Counter()
    hostile_codes: Counter = Counter()
    samples: list[tuple[float, float]] = []
    stop_at = time.monotonic() + duration
    start = time.monotonic()
    tasks = [client(i, port, vocab, stop_at, stats, errors) for i in range(clients)]
    if hostile:
        tasks.append(hostile_calls(port, vocab, hostile, duration / 3, hostile_codes))
    await asyncio.gather(sample_rss(pid, stop_at, samples), *tasks)
    elapsed = time.monotonic() - start
    quarter = samples[len(samples) // 4][1]
    print(f"clients={clients} duration={duration:.0f}s elapsed={elapsed:.1f}s")
    print(
        f"calls={stats['calls']} cancelled={stats['cancelled']} tokens={stats['tokens']} "
        f"({stats['tokens'] / elapsed:.0f} tok/s streamed)"
    )
    print(f"errors={sum(errors.values())} {dict(errors)}")
    if hostile:
        print(f"hostile calls={hostile} statuses={dict(hostile_codes)}")
    print(
        f"server RSS MiB: start={samples[0][1]:.0f} at25%={quarter:.0f} end={samples[-1][1]:.0f} "
        f"max={max(s[1] for s in samples):.0f} growth-after-warmup={samples[-1][1] - quarter:+.0f}"
    )
    print(
        "RSS over time: "
        + " ".join(f"{t:.0f}s:{rss:.0f}" for t, rss in samples[:: max(1, len(samples) // 12)])
    )
    return sum(errors.values())


def main(argv: list[str] | None = None) -> int:
    """Build the checkpoint, start the server, run the load, stop everything."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="10 s instead of --duration")
    parser.add_argument(
        "--hostile", type=int, default=0, help="overflow-seed Generate calls sent mid-run"
    )
    args = parser.parse_args(argv)
    duration = 10.0 if args.quick else args.duration
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ckpt"
        vocab = write_checkpoint(directory)
        server, port = start_server(directory)
        try:
            errors = asyncio.run(
                run_load(port, server.pid, vocab, args.clients, duration, args.hostile)
            )
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    print(f"server exit code {server.returncode}")
    return 1 if errors or server.returncode else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
