"""Served greedy decode as a user meets it vs HF `generate(do_sample=False)`, in the same run.

    python -m bench.bench_serve [--quick] [--hidden 256 1024] [--batch 1 8] [--rounds 3]
                                [--transport grpc http openai]
                                [--server-flag=--batch-wait-ms=0 ...] [--device cpu|cuda]

For each model size a random Llama checkpoint (HF format, 4 layers, 8/4 heads, no EOS so every
request makes all its tokens) is written to a temporary directory and served by `python -m
services.inference serve --load DIR --port 0` — `meshline serve inference` with default flags
(plus any `--server-flag`, for diagnosis) — in a child process. Each round times, alternately:
ours, `batch` concurrent Generate calls over gRPC on localhost (16-token prompts, 64 new tokens,
greedy; one client channel for the whole run, as a client program keeps one); HF, one
`generate(do_sample=False)` over the same `batch` prompts in this process (torch's default
threads, eager attention). Printed: ms per new token of each request (wall time / 64, so at
batch 8 one such "token" is a step of 8 tokens; min and median over rounds) and HF/ours (> 1 =
we are faster): of the minima, of the medians, and "paired", the median over rounds of each
round's ratio (ours and HF run back to back in a round, so a machine whose speed drifts slows
both). Ours must return HF's tokens; where a row differs, the benchmark prints HF's top-2 logit
margin at the first differing token and whether ours equals HF's own tokens for that prompt
generated alone (HF's batched and single runs may break an fp32 tie differently).

`--dtype bfloat16` stores the checkpoint in bf16, as today's checkpoints ship: the server loads
it with its default `--dtype auto` (bf16) and HF runs in bf16 too, as `from_pretrained` loads
it. bf16 paths round differently (ours: a bf16 prefill and KV cache, decode steps in fp32
arithmetic; HF: every intermediate), so no side's greedy tokens are exact: printed instead is
how many leading new tokens of each equal HF's in fp32 on the same stored weights. `--dtype
float16` does the same for fp16 checkpoints (Llama 2's, for one).

For the hidden-1024 model the roofline is printed too: a batch-1 decode step must stream every
weight the step multiplies by (the layers and the output head; the embedding is only gathered),
so time per token >= weight bytes / memory bandwidth, the bandwidth measured in this run after
every round (reading, copying and a matrix-vector product over a 512 MiB array, in 4 KiB and in
transparent huge pages on the CPU; the best of all). % of roofline = that bound / measured time per token.

Device: the server loads on the device `meshline serve inference` picks (CUDA when one is
present, else the CPU; `--device` pins it through MESHLINE_DEVICE), and HF runs on the same
device: eager attention on the CPU (as before), sdpa (HF's default) on CUDA. On CUDA the
bandwidth is the device's, measured the same way with the device synchronised.

Transports: `--transport grpc` (default, Generate calls), `--transport http` (the OpenAI
`/v1/completions` endpoint of the same server started with `--http-port 0`, stdlib HTTP, one
thread and connection per request; token-id prompts, temperature 0, `logprobs: 0` so that the
reply carries the token ids) or `--transport openai` (the same endpoint through the `openai`
package's `AsyncOpenAI`, one client for the run, as an OpenAI user's program sends them).
`--transport grpc http openai` drives them against ONE server process, alternating within each
round: compare the fronts that way, since `--cpu-linear auto` times the layouts at each start
and two server processes may keep different ones. Another front end plugs in by adding a
client class with the same `generate(prompts, max_new_tokens)` and `close()` coroutines to
TRANSPORTS.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kernels import device as devices
from kernels.cpu.hugepages import huge_page_buffer
from kernels.device import DEVICE_ENV

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600.0
SHAPES = {
    256: dict(hidden=256, layers=4, heads=8, kv=4, ffn=704, vocab=4096),
    1024: dict(hidden=1024, layers=4, heads=8, kv=4, ffn=2816, vocab=4096),
}
PROMPT_LEN = 16
NEW_TOKENS = 64


def write_checkpoint(
    shape: dict, directory: Path, device: str = "cpu", dtype: str = "float32"
) -> Any:
    """A random HF Llama checkpoint of `shape` in `directory`, stored in `dtype` ("float32",
    "bfloat16" as today's checkpoints are, or "float16" as Llama 2's); returns the HF model
    (eval) on `device`, in fp32 with the stored (rounded) values."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    attention = "eager" if device == "cpu" else "sdpa"
    hf = LlamaForCausalLM._from_config(config, attn_implementation=attention).eval()
    with torch.no_grad():  # larger weights: peaked logits, no near-ties between kernels
        for name, param in hf.named_parameters():
            if "norm" not in name:
                param.mul_(10.0)
        hf.to(getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()},
        str(directory / "model.safetensors"),
    )
    hf.config.dtype = dtype
    (directory / "config.json").write_text(hf.config.to_json_string())
    return hf.float().to(device)


def start_server(
    directory: Path,
    transports: tuple[str, ...] = ("grpc",),
    flags: tuple[str, ...] = (),
    device: str | None = None,
) -> tuple[subprocess.Popen, dict[str, int]]:
    """`python -m services.inference serve --load DIR --port 0` (default flags unless `flags`
    adds some; plus `--http-port 0` for the HTTP transports; MESHLINE_DEVICE=`device` if given)
    and the port of each of `transports`."""
    command = [sys.executable, "-m", "services.inference", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--load", str(directory), *flags]
    if HTTP_TRANSPORTS & set(transports):
        command += ["--http-port", "0"]
    env = {**os.environ, DEVICE_ENV: device} if device else None
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    assert server.stderr is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    ports: dict[str, int] = {}
    seen: list[str] = []  # the server's log so far, to say why it did not start
    for line in server.stderr:
        seen = [*seen[-29:], line]
        grpc_match = re.search(r"serving .* on \S+:(\d+)", line)
        http_match = re.search(r"HTTP API on https?://\S+:(\d+)/v1", line)
        if grpc_match:
            ports["grpc"] = int(grpc_match.group(1))
        if http_match:
            ports.update(dict.fromkeys(HTTP_TRANSPORTS, int(http_match.group(1))))
        if "grpc" in ports and all(t in ports for t in transports):
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, ports
        if time.monotonic() > deadline:
            break
    server.kill()
    server.wait(60)
    raise RuntimeError(
        f"the inference server did not start (exit {server.returncode}); its last lines:\n"
        + "".join(seen)
    )


class GrpcClient:
    """Greedy Generate calls over gRPC, one call per prompt, all in flight together, on one
    channel kept open across calls (gRPC's performance guide: reuse channels; a channel opened
    per round cost 7 ms a round at batch 8, bench/RESULTS.md). Use it in one event loop."""

    def __init__(self, port: int) -> None:
        self.address = f"127.0.0.1:{port}"
        self._channel: Any = None
        self._stub: Any = None

    async def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        import grpc

        # the stubs are generated at setup; the HTTP transports and --help work without them
        from meshline.inference.v1 import inference_pb2 as pb
        from meshline.inference.v1 import inference_pb2_grpc as pb_grpc

        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = pb_grpc.InferenceServiceStub(self._channel)
        params = pb.SamplingParams(max_new_tokens=max_new_tokens, do_sample=False)
        calls = [
            self._stub.Generate(pb.GenerateRequest(prompt_token_ids=p, params=params), timeout=600)
            for p in prompts
        ]
        replies = await asyncio.gather(*calls)
        return [list(r.sequences[0].token_ids) for r in replies]

    async def close(self) -> None:
        """Close the channel (in the loop that made it)."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class HttpClient:
    """Greedy OpenAI `/v1/completions` calls (token-id prompts, temperature 0), one call per
    prompt on its own connection, all in flight together (stdlib HTTP, one thread per call).

    The threads are this call's own: `asyncio.to_thread` would use the loop's default executor,
    which has min(32, CPUs + 4) workers — 6 on a 2-core machine — so at batch 8 two requests
    waited for the first six to finish and the server decoded two batches one after the other
    (issue #21: "HTTP is 1.3-2 ms per step slower than gRPC at batch 8" was this).
    """

    def __init__(self, port: int) -> None:
        self.port = port

    async def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="http") as pool:
            calls = [loop.run_in_executor(pool, self._complete, p, max_new_tokens) for p in prompts]
            return list(await asyncio.gather(*calls))

    async def close(self) -> None:
        """Nothing is kept open between calls."""

    def _complete(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        import http.client

        # logprobs 0: the generated tokens come back as "token_id:<id>" (no tokenizer here).
        body = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0, "logprobs": 0}
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            connection.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            reply = json.loads(response.read())
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {reply}")
        tokens = reply["choices"][0]["logprobs"]["tokens"]
        return [int(t.removeprefix("token_id:")) for t in tokens]


class OpenAIClient:
    """Greedy `/v1/completions` calls through the `openai` package's async client, as an
    OpenAI user's program sends them: one `AsyncOpenAI` for the run (its connection pool kept),
    every request of a batch in flight together in this event loop."""

    def __init__(self, port: int) -> None:
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self._client: Any = None
        self._model = ""

    async def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        import openai

        if self._client is None:
            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key="-", max_retries=0)
            self._model = (await self._client.models.list()).data[0].id
        calls = [
            self._client.completions.create(
                model=self._model,
                prompt=prompt,
                max_tokens=max_new_tokens,
                temperature=0,
                logprobs=0,  # the tokens come back as "token_id:<id>" (no tokenizer here)
                timeout=600,
            )
            for prompt in prompts
        ]
        replies = await asyncio.gather(*calls)
        return [
            [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
            for reply in replies
        ]

    async def close(self) -> None:
        """Close the client's connections (in the loop that opened them)."""
        if self._client is not None:
            await self._client.close()
            self._client = None


HTTP_TRANSPORTS = {"http", "openai"}
"""Transports that talk to the server's OpenAI HTTP front."""
TRANSPORTS = {"grpc": GrpcClient, "http": HttpClient, "openai": OpenAIClient}
"""Front ends the benchmark can drive: name -> class(port) with `async generate(...)` and
`async close()`, all called in one event loop."""


def hf_generate(hf: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    ids = torch.tensor(prompts, device=hf.device)
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].tolist()


def agreeing(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Median over rows of how many leading tokens of `ours` equal `theirs`."""
    counts = [
        next((i for i, (a, b) in enumerate(zip(o, t, strict=True)) if a != b), len(o))
        for o, t in zip(ours, theirs, strict=True)
    ]
    return statistics.median(counts)


def explain_difference(
    hf: Any, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]
) -> None:
    """For each row where our greedy tokens differ from HF's batched `generate`: the first
    differing step, HF's top-2 logit margin there (fp32, teacher-forced on HF's tokens), and
    whether ours equals HF's own tokens for that prompt generated alone. A margin at fp32
    rounding that HF's batch and single runs decide differently is a tie, not an error."""
    for row, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
        if mine == ref:
            continue
        step = next(i for i, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b)
        ids = torch.tensor([prompts[row] + ref[:step]], device=hf.device)
        with torch.inference_mode():
            top = hf(ids).logits[0, -1].float().topk(2).values.tolist()
        alone = hf_generate(hf, [prompts[row]], len(ref))[0]
        print(
            f"    row {row}: first differs at new token {step}, HF's top-2 logits "
            f"{top[0]:.6f} / {top[1]:.6f} (margin {top[0] - top[1]:.2e}); ours "
            f"{'equals' if mine == alone else 'differs from'} HF's tokens for this prompt alone, "
            f"which {'differ from' if alone != ref else 'equal'} HF's batched ones"
        )


def memory_bandwidth(mib: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Best bytes/s streaming a large fp32 array on `device` (default threads): the best of
    reading it (torch.sum), copying it (read + write bytes) and a matrix-vector product over it
    (the decode access pattern), best of `repeats` each. On the CPU the arrays are measured
    twice, in ordinary 4 KiB pages and in transparent huge pages where the system has them (the
    server keeps its weights there: `kernels.cpu.hugepages`), and the best of both counts."""
    numel = mib * 2**20 // 4
    layouts = [(torch.ones(numel, device=device), torch.empty(numel, device=device))]
    if torch.device(device).type == "cpu":
        pair = [huge_page_buffer(numel * 4) for _ in range(2)]
        if pair[0] is not None and pair[1] is not None:
            layouts.append((pair[0].view(torch.float32).fill_(1.0), pair[1].view(torch.float32)))
    vector = torch.ones(4096, device=device)
    nbytes = numel * 4
    sync = devices.synchronize if torch.device(device).type != "cpu" else (lambda: None)
    best = 0.0
    for _ in range(repeats):
        for x, y in layouts:
            for moved, run in (
                (nbytes, lambda x=x: torch.sum(x)),
                (2 * nbytes, lambda x=x, y=y: y.copy_(x)),
                (nbytes, lambda x=x: torch.mv(x.view(-1, 4096), vector)),
            ):
                sync()
                start = time.perf_counter()
                run()
                sync()
                best = max(best, moved / (time.perf_counter() - start))
    return best


def streamed_weight_bytes(hf: Any) -> int:
    """Bytes a batch-1 decode step reads: every parameter but the (gathered) embedding."""
    embed = hf.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in hf.parameters() if p is not embed)


def _check_served_tokens(
    runner: asyncio.Runner,
    clients: dict[str, Any],
    hf: Any,
    reference: Any,
    prompts: list[list[int]],
    batches: list[int],
    hidden: int,
    dtype: str,
) -> None:
    """Warm both sides up and print whether the served greedy tokens are HF's (in 16 bits: how
    many leading tokens of each side equal HF's in fp32 on the stored weights)."""
    for b in batches:
        theirs = hf_generate(reference, prompts[:b], NEW_TOKENS)
        for t, client in clients.items():
            got = runner.run(client.generate(prompts[:b], NEW_TOKENS))
            if hf is not reference:  # 16 bits round differently on every path
                hf_own = hf_generate(hf, prompts[:b], NEW_TOKENS)
                print(
                    f"  hidden {hidden} batch {b} ({t}): new tokens equal to HF fp32's "
                    f"on the stored weights before the first difference, median over "
                    f"rows: ours {agreeing(got, theirs)}, HF {dtype} "
                    f"{agreeing(hf_own, theirs)} (of {NEW_TOKENS})"
                )
                continue
            print(
                f"  hidden {hidden} batch {b} ({t}): greedy tokens identical to HF: {got == theirs}"
            )
            if got != theirs:
                explain_difference(reference, prompts[:b], got, theirs)


def _time_rounds(
    runner: asyncio.Runner,
    clients: dict[str, Any],
    hf: Any,
    prompts: list[list[int]],
    batches: list[int],
    rounds: int,
    bandwidth_device: str | None,
) -> tuple[dict[tuple[str, int], list[float]], float | None]:
    """Seconds of each (transport or "hf", batch) per round, alternating the sides; and the
    best memory bandwidth measured after each round when `bandwidth_device` is given."""
    times: dict[tuple[str, int], list[float]] = {}
    bandwidth = None
    for _ in range(rounds):
        for b in batches:
            for t, client in clients.items():
                start = time.perf_counter()
                runner.run(client.generate(prompts[:b], NEW_TOKENS))
                times.setdefault((t, b), []).append(time.perf_counter() - start)
            start = time.perf_counter()
            hf_generate(hf, prompts[:b], NEW_TOKENS)
            times.setdefault(("hf", b), []).append(time.perf_counter() - start)
        # measured as often as the decodes: the machine may be shared
        if bandwidth_device is not None:
            bandwidth = max(bandwidth or 0.0, memory_bandwidth(device=bandwidth_device))
    return times, bandwidth


def _print_size(
    hidden: int,
    batches: list[int],
    transports: tuple[str, ...],
    times: dict[tuple[str, int], list[float]],
    bandwidth: float | None,
    hf: Any,
) -> None:
    for b, transport in itertools.product(batches, transports):
        o = [t / NEW_TOKENS * 1e3 for t in times[(transport, b)]]
        h = [t / NEW_TOKENS * 1e3 for t in times[("hf", b)]]
        line = (
            f"hidden {hidden} batch {b} ({transport}): ms per token per request, ours min {min(o):.2f} "
            f"median {statistics.median(o):.2f}, HF min {min(h):.2f} median "
            f"{statistics.median(h):.2f} -> HF/ours min {min(h) / min(o):.2f}x, median "
            f"{statistics.median(h) / statistics.median(o):.2f}x, paired "
            f"{statistics.median(hr / orr for hr, orr in zip(h, o, strict=True)):.2f}x"
        )
        if bandwidth is not None and b == 1:
            bound_ms = streamed_weight_bytes(hf) / bandwidth * 1e3
            line += (
                f"; roofline {bound_ms:.2f} ms/token ({streamed_weight_bytes(hf) / 2**20:.0f} "
                f"MiB at {bandwidth / 1e9:.1f} GB/s): ours at {bound_ms / min(o):.0%} (min), "
                f"{bound_ms / statistics.median(o):.0%} (median)"
            )
        print(line, flush=True)


def run_size(
    hidden: int,
    batches: list[int],
    rounds: int,
    transports: tuple[str, ...],
    flags: tuple[str, ...] = (),
    device: str = "cpu",
    dtype: str = "float32",
) -> None:
    shape = SHAPES[hidden]
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_checkpoint(shape, Path(tmp) / "ckpt", device, dtype)
        # The baseline runs in the checkpoint's dtype, as `from_pretrained` loads it; greedy
        # tokens are checked against the same weights in fp32 (what our steps compute in).
        reference = hf
        if dtype != "float32":
            hf = copy.deepcopy(reference).to(getattr(torch, dtype))
        server, ports = start_server(Path(tmp) / "ckpt", transports, flags, device)
        runner = asyncio.Runner()  # one event loop for every call, as a client program has
        try:
            clients = {t: TRANSPORTS[t](ports[t]) for t in transports}
            gen = torch.Generator().manual_seed(1)
            prompts = torch.randint(0, shape["vocab"], (max(batches), PROMPT_LEN), generator=gen)
            prompts_l = prompts.tolist()
            _check_served_tokens(runner, clients, hf, reference, prompts_l, batches, hidden, dtype)
            times, bandwidth = _time_rounds(
                runner, clients, hf, prompts_l, batches, rounds, device if hidden >= 1024 else None
            )
            for client in clients.values():
                runner.run(client.close())
        finally:
            runner.close()
            server.terminate()
            server.wait(60)
    _print_size(hidden, batches, transports, times, bandwidth, hf)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_serve", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="hidden 256 only, 2 rounds")
    parser.add_argument("--hidden", type=int, nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--transport",
        choices=sorted(TRANSPORTS),
        nargs="+",
        default=["grpc"],
        help="front end(s) to drive; several: all against one server process, alternated",
    )
    parser.add_argument(
        "--server-flag",
        action="append",
        default=[],
        help="a flag added to the server's command line (repeat; e.g. "
        "--server-flag=--batch-wait-ms=0); the headline runs with none",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the checkpoint's dtype; the server loads it with its default --dtype auto and "
        "HF runs in it too (bfloat16: as today's checkpoints ship; float16: as Llama 2's)",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the server and HF run (default: where `meshline serve inference` loads: "
        "CUDA when present, else the CPU)",
    )
    args = parser.parse_args(argv)
    device = devices.current().type if args.device == "auto" else args.device
    if device not in ("cpu", "cuda"):
        parser.error(f"this benchmark runs HF on the CPU or CUDA, not on {device!r}")
    hidden = args.hidden or ([256] if args.quick else sorted(SHAPES))
    rounds = args.rounds or (2 if args.quick else 3)
    print(
        json.dumps(
            {
                "prompt": PROMPT_LEN,
                "new_tokens": NEW_TOKENS,
                "rounds": rounds,
                "flags": " ".join(args.server_flag) or "default",
                "dtype": args.dtype,
                "device": device,
            }
        )
    )
    for h in hidden:
        transports = tuple(dict.fromkeys(args.transport))
        run_size(h, args.batch, rounds, transports, tuple(args.server_flag), device, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
