"""The load generator's accounting: per request timelines, per concurrency level summaries.

Definitions (all from the client's clock, `time.perf_counter()` seconds):
- TTFT: first chunk carrying generated tokens minus the request's send time;
- inter-token latency (ITL): the gap between consecutive token-carrying chunks of one request,
  pooled over every request of the level (a chunk with k tokens is one gap, as vLLM's
  benchmark_serving counts them; Meshline sends one token a chunk unless speculating);
- TPOT: per request, (last chunk - first chunk) / (tokens - 1), requests of 2+ tokens;
- output tokens/s: generated tokens of the successful requests / the level's wall time (first
  send to last completion); requests/s likewise;
- percentiles are nearest-rank (p99 of 50 values is the largest), as bench/served.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request of a run as the client saw it."""

    sent: float
    """When it was sent."""
    arrivals: list[float] = field(default_factory=list)
    """When each chunk carrying generated tokens arrived."""
    chunk_tokens: list[int] = field(default_factory=list)
    """Tokens each of those chunks carried (1 per chunk over HTTP: its text is one token)."""
    done: float | None = None
    """When the response ended (None while open)."""
    prompt_tokens: int | None = None
    """Prompt tokens the server reported (HTTP usage; None over gRPC)."""
    usage_tokens: int | None = None
    """Generated tokens the server reported (HTTP usage; None over gRPC)."""
    finish_reason: str | None = None
    """Why it ended ("length", "stop", ...)."""
    error: str | None = None
    """What failed (None: it succeeded)."""

    @property
    def tokens(self) -> int:
        """Generated tokens counted on the client."""
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        """Whether it completed without error and produced a token."""
        return self.error is None and self.done is not None and bool(self.arrivals)


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(concurrency: int, records: list[RequestRecord]) -> dict[str, Any]:
    """The level's figures (see the module docstring); times in milliseconds."""
    good = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    ends = [r.done for r in records if r.done is not None]
    wall = (max(ends) - min(r.sent for r in records)) if ends else math.nan
    ttft = [(r.arrivals[0] - r.sent) * 1e3 for r in good]
    itl = [(b - a) * 1e3 for r in good for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    tpot = [(r.arrivals[-1] - r.arrivals[0]) / (r.tokens - 1) * 1e3 for r in good if r.tokens >= 2]
    tokens = sum(r.tokens for r in good)
    usage = [r.usage_tokens for r in good]
    errors: dict[str, int] = {}
    for r in failed:
        kind = (r.error or "no tokens").split(":", 1)[0]
        errors[kind] = errors.get(kind, 0) + 1
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "succeeded": len(good),
        "errors": len(failed),
        "error_kinds": errors,
        "first_error": next((r.error for r in failed if r.error), None),
        "wall_s": wall,
        "output_tokens": tokens,
        "usage_tokens": sum(u for u in usage if u is not None) if None not in usage else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in good),
        "output_tok_s": tokens / wall if good else 0.0,
        "requests_s": len(good) / wall if good else 0.0,
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "itl_p50_ms": percentile(itl, 0.5),
        "itl_p99_ms": percentile(itl, 0.99),
        "tpot_p50_ms": percentile(tpot, 0.5),
        "mean_output_tokens": tokens / len(good) if good else 0.0,
    }


COLUMNS = (
    ("streams", "concurrency", "{}"),
    ("requests", "requests", "{}"),
    ("errors", "errors", "{}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("req/s", "requests_s", "{:.2f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
    ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"),
    ("mean out tokens", "mean_output_tokens", "{:.0f}"),
)
"""The Markdown table's columns: header, summary key, format."""


def markdown_table(levels: list[dict[str, Any]]) -> str:
    """One row per concurrency level."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |"]
    lines.append("|" + "---|" * len(COLUMNS))
    for level in levels:
        cells = []
        for _, key, fmt in COLUMNS:
            value = level[key]
            is_nan = isinstance(value, float) and math.isnan(value)
            cells.append("n/a" if is_nan else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
