"""`bench.bench_quant_serve --served`: float32, int8 and int4 SmolLM2 each served by a
`python -m services.inference serve` process, batch-1 greedy decode timed over gRPC in
interleaved rounds, beside llama.cpp on the same weights where it can be imported (the module
docstring of bench/bench_quant_serve.py says what is measured)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_quant_serve import PROMPT, checkpoint
from engine.loading import load_checkpoint
from engine.quantized_model import quantized_bytes

SERVED = [
    ("float", None, None, False, False),
    ("int8-channel", "int8", None, False, False),
    ("int4-g32-affine", "int4", 32, True, False),
    ("int8-channel-keep-emb", "int8", None, False, True),
    ("int4-g32-affine-keep-emb", "int4", 32, True, True),
]
"""(checkpoint, --quantize, --group-size, --quantize-affine, --keep-embedding) of each served
variant: int4 in groups of 32 with a zero point, the layout of llama.cpp's Q4_1 (whose grid the
weights, read from a Q4_1 file, already lie on; int4 group 64 symmetric ends this prompt at
once); each quantized one with its embedding/head int8 (the default) and kept in fp32."""

GGUF = ["F32", "Q8_0", "Q4_1"]
"""llama.cpp file types timed beside them (Q4_1: the shipped file; the others written from it)."""


def streamed_bytes(directory: Path) -> int:
    """Bytes of the model `meshline serve` loads from `directory`: its quantized layers' codes
    and scales plus every other tensor (what a decode step reads, the embedding row aside)."""
    quant, other = quantized_bytes(load_checkpoint(directory).model)
    return quant + other


def gguf_files(work: Path, threads: int) -> list[Path]:
    """The GGUF files of GGUF's types, written by llama.cpp from the shipped Q4_1 unless there."""
    from bench.bench_quantize import smollm2_gguf
    from bench.llama_cpp_decode import quantize

    shipped = smollm2_gguf()
    files = []
    for kind in GGUF:
        path = shipped if kind == "Q4_1" else work / f"smollm2.{kind}.gguf"
        if not path.exists():
            quantize(shipped, path, kind, threads)
        files.append(path)
    return files


def run_served(work: Path | None, tokens: int, rounds: int, threads: int) -> int:
    """Run the served comparison and print its table (see the module docstring)."""
    import torch

    from bench.bench_serve import GrpcClient, memory_bandwidth, start_server
    from bench.llama_cpp_decode import available

    # SIGTERM (a timeout) unwinds through the `finally` below, which stops the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the servers' (and llama.cpp's) threads
    work = work or Path(tempfile.mkdtemp(prefix="bench-quant-serve-"))
    directories = {name: checkpoint(work, name, *rest) for name, *rest in SERVED}
    sizes = {name: streamed_bytes(d) for name, d in directories.items()}
    why_not_llama = available()
    files = gguf_files(work, threads) if why_not_llama is None else []
    sizes |= {f"llama.cpp {k}": f.stat().st_size for k, f in zip(GGUF, files, strict=False)}
    rates: dict[str, list[float]] = {name: [] for name in sizes}
    firsts: dict[str, list[int]] = {}
    llama: subprocess.Popen[str] | None = None
    servers: dict[str, tuple[subprocess.Popen, dict[str, int]]] = {}
    clients: dict[str, GrpcClient] = {}
    loop = asyncio.new_event_loop()
    try:  # everything started from here on is stopped in `finally`
        if files:
            llama = subprocess.Popen(
                [sys.executable, "-m", "bench.llama_cpp_decode", "--threads", str(threads),
                 "--tokens", str(tokens), "--prompt", ",".join(map(str, PROMPT)),
                 *map(str, files)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True,
            )  # fmt: skip
            assert llama.stdout is not None
            assert json.loads(llama.stdout.readline()).get("ready"), "llama.cpp did not load"
        for name, directory in directories.items():
            servers[name] = start_server(directory)
            clients[name] = GrpcClient(servers[name][1]["grpc"])
        bandwidth = [memory_bandwidth(repeats=3)]
        for client in clients.values():  # warm-up: first calls build the decode step
            loop.run_until_complete(client.generate([PROMPT], 4))
        for r in range(rounds):
            order = list(clients)
            order = order[r % len(order) :] + order[: r % len(order)]
            for name in order:
                client = clients[name]
                start = time.perf_counter()
                loop.run_until_complete(client.generate([PROMPT], 1))
                one = time.perf_counter() - start
                start = time.perf_counter()
                ids = loop.run_until_complete(client.generate([PROMPT], tokens + 1))[0]
                whole = time.perf_counter() - start
                rates[name].append((len(ids) - 1) / max(whole - one, 1e-9))
                firsts[name] = ids[:8]
                if len(ids) < tokens + 1:
                    print(f"{name}: stopped after {len(ids)} of {tokens + 1} tokens", flush=True)
            if llama is not None:
                assert llama.stdin is not None and llama.stdout is not None
                llama.stdin.write("round\n")
                llama.stdin.flush()
                for kind, result in zip(
                    GGUF, json.loads(llama.stdout.readline()).values(), strict=True
                ):
                    rates[f"llama.cpp {kind}"].append(result["tokens_per_s"])
                    firsts[f"llama.cpp {kind}"] = result["first_tokens"]
        bandwidth.append(memory_bandwidth(repeats=3))
    finally:
        for client in clients.values():
            loop.run_until_complete(client.close())
        loop.close()
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
        if llama is not None:
            llama.terminate()
            llama.wait(60)
    _report(rates, sizes, firsts, bandwidth, tokens, rounds, threads, why_not_llama)
    return 0


def _report(
    rates: dict[str, list[float]],
    sizes: dict[str, int],
    firsts: dict[str, list[int]],
    bandwidth: list[float],
    tokens: int,
    rounds: int,
    threads: int,
    why_not_llama: str | None,
) -> None:
    print(
        f"SmolLM2-135M-Instruct, batch 1, greedy, {tokens} new tokens (decode only), {rounds} "
        f"interleaved rounds, {threads} thread(s); memory bandwidth "
        f"{bandwidth[0] / 1e9:.1f} GB/s before, {bandwidth[1] / 1e9:.1f} GB/s after"
    )
    print(f"{'engine / weights':22s} {'MiB/tok':>8s} {'best':>6s} {'median':>6s} "
          f"{'x fp32':>6s} {'GB/s':>5s} {'of bw':>5s}  first tokens")  # fmt: skip
    top = max(bandwidth)
    for name, values in rates.items():
        base = rates["llama.cpp F32" if name.startswith("llama.cpp") else "float"]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        reached = sizes[name] * max(values)
        label = name if name.startswith("llama.cpp") else f"meshline {name}"
        print(f"{label:22s} {sizes[name] / 2**20:8.1f} {max(values):6.1f} "
              f"{statistics.median(values):6.1f} {ratio:6.2f} {reached / 1e9:5.1f} "
              f"{reached / top:5.0%}  {firsts[name]}")  # fmt: skip
    if why_not_llama is not None:
        print(f"llama.cpp: not measured: {why_not_llama}")
    else:
        for ours, theirs in (("int8-channel", "Q8_0"), ("int4-g32-affine", "Q4_1")):
            ratio = statistics.median(
                a / b for a, b in zip(rates[ours], rates[f"llama.cpp {theirs}"], strict=True)
            )
            print(f"meshline {ours} / llama.cpp {theirs}: {ratio:.2f} (median of rounds)")
