"""Per-adapter Prometheus metrics: requests, prompt and generated tokens, time to first token.

Each series carries an `adapter` label, the LoRA adapter's name as requests pick it (their
`model` field, gRPC's `lora_adapter`); base-model requests are not in these series (the
unlabelled totals in services/inference/metrics.py count every request). Adapter names come
from clients that may load and unload adapters at run time, so the label values are bounded by
what the engine serves: a scrape shows exactly the adapters loaded at that moment (each with
zeros before its first request) and forgets the counts of adapters unloaded since, so at most
`--max-loras` adapter label values exist at once whatever names clients send. An adapter
unloaded and loaded again starts from zero (a counter reset, which Prometheus's `rate` handles).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from engine.engine import Engine


@dataclass
class AdapterStats:
    """What one adapter's requests did since it was loaded (or first used)."""

    requests: Counter[str] = field(default_factory=Counter)
    """Finished requests by finish reason of sequence 0 (as the unlabelled counter)."""
    prompt_tokens: int = 0
    """Prompt tokens of its requests (counted when each request finishes)."""
    generated_tokens: int = 0
    """Tokens generated with it, every sequence counted."""
    ttft_counts: list[int] = field(default_factory=list)
    """Time to first token: observations per bucket (not cumulative), the last one +Inf."""
    ttft_sum: float = 0.0
    """Time to first token: the sum of the observations (seconds)."""


class AdapterMetrics(Collector):
    """The per-adapter series, kept here and shown for the watched engine's loaded adapters."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self._buckets = buckets
        self._lock = threading.Lock()
        self._stats: dict[str, AdapterStats] = {}
        self._engine: weakref.ReferenceType[Engine] | None = None

    def watch(self, engine: Engine) -> None:
        """Show the adapters `engine` serves (the engine a server instruments)."""
        self._engine = weakref.ref(engine)
        with self._lock:
            self._stats.clear()

    def _entry(self, adapter: str) -> AdapterStats:
        stats = self._stats.get(adapter)
        if stats is None:
            stats = AdapterStats(ttft_counts=[0] * (len(self._buckets) + 1))
            self._stats[adapter] = stats
        return stats

    def generated(self, adapter: str, tokens: int) -> None:
        """Count `tokens` generated with `adapter`."""
        with self._lock:
            self._entry(adapter).generated_tokens += tokens

    def first_token(self, adapter: str, seconds: float) -> None:
        """Observe one request's time to first token."""
        with self._lock:
            stats = self._entry(adapter)
            stats.ttft_counts[bisect.bisect_left(self._buckets, seconds)] += 1
            stats.ttft_sum += seconds

    def finished(self, adapter: str, prompt_tokens: int, finish: str) -> None:
        """Count one finished (or cancelled) request and its prompt tokens."""
        with self._lock:
            stats = self._entry(adapter)
            stats.requests[finish] += 1
            stats.prompt_tokens += prompt_tokens

    def _loaded(self) -> list[str]:
        engine = self._engine() if self._engine is not None else None
        if engine is None or engine.adapters is None:
            return []
        return list(engine.adapters.names())

    def collect(self) -> Iterator[Metric]:
        loaded = self._loaded()
        with self._lock:
            for name in set(self._stats) - set(loaded):  # unloaded: its label values go
                del self._stats[name]
            snapshot = {name: _copy(self._entry(name)) for name in loaded}
        requests = CounterMetricFamily(
            "meshline_inference_lora_requests",
            "Generation requests finished per LoRA adapter, by finish reason of sequence 0.",
            labels=["adapter", "finish_reason"],
        )
        prompt = CounterMetricFamily(
            "meshline_inference_lora_prompt_tokens",
            "Prompt tokens of the requests of each LoRA adapter.",
            labels=["adapter"],
        )
        generated = CounterMetricFamily(
            "meshline_inference_lora_generated_tokens",
            "Tokens generated with each LoRA adapter, every sequence counted.",
            labels=["adapter"],
        )
        ttft = HistogramMetricFamily(
            "meshline_inference_lora_time_to_first_token_seconds",
            "Per LoRA adapter: from submitting a request to its first generated token.",
            labels=["adapter"],
        )
        for name, stats in snapshot.items():
            for finish, count in sorted(stats.requests.items()):
                requests.add_metric([name, finish], count)
            prompt.add_metric([name], stats.prompt_tokens)
            generated.add_metric([name], stats.generated_tokens)
            cumulative, buckets = 0, []
            for bound, count in zip((*self._buckets, float("inf")), stats.ttft_counts, strict=True):
                cumulative += count
                buckets.append((_bound(bound), cumulative))
            ttft.add_metric([name], buckets, stats.ttft_sum)
        yield from (requests, prompt, generated, ttft)


def _copy(stats: AdapterStats) -> AdapterStats:
    return AdapterStats(
        Counter(stats.requests),
        stats.prompt_tokens,
        stats.generated_tokens,
        list(stats.ttft_counts),
        stats.ttft_sum,
    )


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def register(buckets: tuple[float, ...]) -> AdapterMetrics:
    """The per-adapter collector, on the default registry (the one `/metrics` serves)."""
    collector = AdapterMetrics(buckets)
    REGISTRY.register(collector)
    return collector
