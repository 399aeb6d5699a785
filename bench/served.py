"""The served endpoint as the #39 benchmarks meet it: `meshline serve inference` in a child
process on localhost, and streamed OpenAI completions timed token by token on the client.

`serving(directory, flags)` starts `python -m services.inference serve --load DIR --port 0
--http-port 0` plus `flags` (the launcher the tests use, tests/served_process.py) and yields the
HTTP port and the server's `KV cache:` line; `stream_completion` sends one `/v1/completions`
request with `stream: true` through the official `openai` client and records when each chunk
arrived (the server sends one chunk per engine step of the request), plus the usage counts the
last chunk carries (`stream_options.include_usage`).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.served_process import HTTP_PORT, METRICS_PORT, launched

MODEL = "bench"
"""The --served-model-name every bench server gets."""
READY_S = 600.0
"""How long a server may take to announce its port (a busy machine loads slowly)."""


@dataclass
class Server:
    """A running bench server."""

    port: int
    """Its HTTP port on 127.0.0.1."""
    kv_cache: str
    """Its `KV cache:` start-up line (what it reserved and why)."""
    flags: tuple[str, ...]
    """The flags it was started with beyond --load and the ports."""
    metrics_port: int | None = None
    """Its Prometheus port, when started with `metrics`."""

    def metrics(self) -> dict[str, float]:
        """Every sample of its /metrics by name (labels dropped: the last sample of a name)."""
        assert self.metrics_port is not None, "start the server with serving(..., metrics=True)"
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def client(self) -> openai.AsyncOpenAI:
        """An `openai` client for this server (no retries: a failure is reported, not hidden)."""
        return openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1",
            api_key="none",
            max_retries=0,
            timeout=3600,
        )


@contextmanager
def serving(
    directory: Path, flags: tuple[str, ...] = (), metrics: bool = False
) -> Iterator[Server]:
    """`meshline serve inference --load directory` with `flags` (and `--metrics-port 0` with
    `metrics`), stopped (SIGTERM) on exit."""
    command = [sys.executable, "-m", "services.inference", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--http-port", "0", "--load", str(directory)]
    command += ["--served-model-name", MODEL, *flags]
    patterns = {"http": HTTP_PORT}
    if metrics:
        command += ["--metrics-port", "0"]
        patterns["metrics"] = METRICS_PORT
    with launched(command, patterns, READY_S) as process:
        lines = [line.strip() for line in process.lines if "KV cache:" in line]
        kv_line = lines[0] if lines else "(no KV cache line logged)"
        kv_line = kv_line[kv_line.find("KV cache:") :]
        yield Server(process.ports["http"], kv_line, flags, process.ports.get("metrics"))


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    sent: float
    """perf_counter() when the request was sent."""
    arrivals: list[float] = field(default_factory=list)
    """perf_counter() of each chunk carrying generated tokens."""
    text: str = ""
    """The generated text."""
    prompt_tokens: int = 0
    """Prompt tokens (from the usage chunk)."""
    completion_tokens: int = 0
    """Generated tokens (from the usage chunk)."""
    finish_reason: str | None = None
    """Why it ended ("length", "stop"; None while open or when cut)."""

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first generated token."""
        return self.arrivals[0] - self.sent

    def gaps(self) -> list[tuple[float, float]]:
        """(arrival, seconds since the previous arrival) of every chunk after the first."""
        return [(b, b - a) for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def stream_completion(
    client: openai.AsyncOpenAI,
    prompt: str | list[int],
    max_tokens: int,
    into: Stream | None = None,
    **fields: Any,
) -> Stream:
    """Sends one streamed completion (greedy unless `fields` say otherwise) and records it in
    `into` (a new Stream if None) as chunks arrive, so a caller can watch it while it runs."""
    stream = into if into is not None else Stream(time.perf_counter())
    stream.sent = time.perf_counter()
    fields.setdefault("temperature", 0)
    response = await client.completions.create(
        model=MODEL,
        prompt=prompt,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **fields,
    )
    async for chunk in response:
        if chunk.choices:
            stream.arrivals.append(time.perf_counter())
            stream.text += chunk.choices[0].text
            stream.finish_reason = chunk.choices[0].finish_reason or stream.finish_reason
        if chunk.usage is not None:
            stream.prompt_tokens = chunk.usage.prompt_tokens
            stream.completion_tokens = chunk.usage.completion_tokens
    return stream


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank (p99 of 50 values is the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    """statistics.median, named here so the benches read alike."""
    return statistics.median(values)


def load_average() -> str:
    """The 1/5/15-minute load averages, to print beside every timing."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
