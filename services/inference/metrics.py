"""Prometheus metrics of the inference engine, shared by the gRPC and HTTP fronts.

`metered(front, prompt_ids, config, protocol)` wraps one request's event stream: it counts
requests, prompt and generated tokens, and observes time to first token and inter-token latency.
`instrument(engine)` records, after every model step, the batch size (active cache rows), the
queue depth (requests waiting for rows) and KV-cache use (rows and token slots held); with the
paged KV cache also its blocks used and free and the prefix cache's lookups and hits (vLLM's
counters: the hit rate is `rate(hits) / rate(queries)`); on a speculative server
(--speculative-config) the draft tokens proposed and accepted. Weight updates (issue #41) set the
served version and observe their receive and swap seconds. Requests that name a LoRA adapter
are also counted per adapter (services/inference/adapter_metrics.py: label values bounded by the
adapters loaded).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator

from prometheus_client import Counter, Gauge, Histogram

from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.paged_pool import PagedPool
from engine.requests import StepEvent
from engine.sampling import SamplingConfig
from engine.validation import InvalidRequest
from services.inference import adapter_metrics

TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

REQUESTS = Counter(
    "meshline_inference_requests_total",
    "Generation requests finished, by protocol (grpc, http) and finish reason of sequence 0.",
    ["protocol", "finish_reason"],
)
PROMPT_TOKENS = Counter(
    "meshline_inference_prompt_tokens_total", "Prompt tokens of generation requests."
)
GENERATED_TOKENS = Counter(
    "meshline_inference_generated_tokens_total", "Tokens generated, every sequence counted."
)
TIME_TO_FIRST_TOKEN = Histogram(
    "meshline_inference_time_to_first_token_seconds",
    "From submitting a request to its first generated token (queueing and prefill included).",
    buckets=TOKEN_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "meshline_inference_inter_token_latency_seconds",
    "Time between consecutive tokens of a sequence (sequence 0 of each request).",
    buckets=TOKEN_BUCKETS,
)
BATCH_SIZE = Histogram(
    "meshline_inference_batch_size",
    "Active cache rows (sequences and beams) in each engine step.",
    buckets=ROW_BUCKETS,
)
QUEUE_DEPTH = Gauge(
    "meshline_inference_queue_depth", "Requests waiting for cache rows after the last step."
)
RUNNING_ROWS = Gauge("meshline_inference_running_rows", "Cache rows in use after the last step.")
KV_CACHE_ROWS_USAGE = Gauge(
    "meshline_inference_kv_cache_rows_usage_ratio", "Share of the KV cache's rows held (0..1)."
)
KV_CACHE_TOKENS_USAGE = Gauge(
    "meshline_inference_kv_cache_tokens_usage_ratio",
    "Share of the KV cache's token slots filled (0..1): rows x max length, or x the window "
    "for sliding-window models, whose rows are rings.",
)
STEPS = Counter("meshline_inference_engine_steps_total", "Engine steps that ran the model.")
WEIGHTS_VERSION = Gauge(
    "meshline_inference_weights_version",
    "Version of the served weights (0: as loaded; raised by each applied UpdateWeights).",
)
WEIGHT_UPDATE_SECONDS = Histogram(
    "meshline_inference_weight_update_seconds",
    "Applied UpdateWeights calls: receive (the stream received, checked, staged and prepared) "
    "and swap (the copy into the served weights, between two engine steps).",
    ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
SPEC_DRAFTS = Counter(
    "meshline_inference_spec_decode_drafts_total",
    "Speculative decoding: target forwards that verified a draft (vLLM's num_drafts).",
)
SPEC_DRAFT_TOKENS = Counter(
    "meshline_inference_spec_decode_draft_tokens_total",
    "Speculative decoding: draft tokens proposed and verified.",
)
SPEC_ACCEPTED_TOKENS = Counter(
    "meshline_inference_spec_decode_accepted_tokens_total",
    "Speculative decoding: draft tokens the served model accepted.",
)
SPEC_ACCEPTANCE_RATE = Gauge(
    "meshline_inference_spec_decode_acceptance_rate",
    "Speculative decoding: accepted / proposed draft tokens since start (0 before any draft).",
)
KV_BLOCKS_USED = Gauge(
    "meshline_inference_kv_cache_blocks_used",
    "Paged KV cache: blocks held by running or prefilling requests (a shared block counts once).",
)
KV_BLOCKS_FREE = Gauge(
    "meshline_inference_kv_cache_blocks_free",
    "Paged KV cache: blocks that can be taken: never used, or cached prefixes nobody holds.",
)
PREFIX_CACHE_QUERIES = Counter(
    "meshline_inference_prefix_cache_queries",
    "Prompt tokens (in full blocks) looked up in the prefix cache at admission.",
)
PREFIX_CACHE_HITS = Counter(
    "meshline_inference_prefix_cache_hits",
    "Of the prompt tokens looked up, those found cached (their prefill skipped).",
)
PREEMPTIONS = Counter(
    "meshline_inference_preemptions",
    "Paged KV cache: running requests preempted when blocks ran out (recomputed later).",
)

ADAPTERS = adapter_metrics.register(TOKEN_BUCKETS)
"""Per-adapter requests, tokens and time to first token (label values: loaded adapters)."""


_last_step: dict[str, float] = {
    "queue": 0.0,
    "rows": 0.0,
    "kv_rows": 0.0,
    "kv_tokens": 0.0,
    "blocks_used": 0.0,
}
_prefix_seen = {"queried": 0, "hit": 0}
"""The engine's prefix-cache totals already added to the counters."""
"""The load gauges' values as of the last model step (read at scrape time, see `instrument`)."""
_spec_seen: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()
"""Per engine, its speculation counts already added to the Prometheus counters."""
_preemptions_seen: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
"""Per engine, its preemptions already added to the Prometheus counter."""


def _observe_speculation(engine: Engine) -> None:
    if engine.speculation is None:
        return
    counts = engine.speculation.stats
    seen = _spec_seen.setdefault(engine, {"verifications": 0, "drafted": 0, "accepted": 0})
    for counter, key in (
        (SPEC_DRAFTS, "verifications"),
        (SPEC_DRAFT_TOKENS, "drafted"),
        (SPEC_ACCEPTED_TOKENS, "accepted"),
    ):
        now = getattr(counts, key)
        counter.inc(now - seen[key])
        seen[key] = now
    if counts.drafted:
        SPEC_ACCEPTANCE_RATE.set(counts.accepted / counts.drafted)


def _observe_step(engine: Engine) -> None:
    rows, waiting = engine.load()
    pool = engine.pool
    BATCH_SIZE.observe(rows)
    _last_step.update(
        queue=waiting,
        rows=rows,
        kv_rows=pool.num_rows / pool.max_rows,
        kv_tokens=pool.slots_used() / pool.slot_capacity,
    )
    if isinstance(pool, PagedPool):
        stats = pool.blocks.stats
        PREFIX_CACHE_QUERIES.inc(stats.queried_tokens - _prefix_seen["queried"])
        PREFIX_CACHE_HITS.inc(stats.hit_tokens - _prefix_seen["hit"])
        _prefix_seen.update(queried=stats.queried_tokens, hit=stats.hit_tokens)
        _last_step["blocks_used"] = pool.blocks.used
    PREEMPTIONS.inc(engine.preemptions - _preemptions_seen.get(engine, 0))
    _preemptions_seen[engine] = engine.preemptions
    STEPS.inc()
    _observe_speculation(engine)


def instrument(engine: Engine) -> None:
    """Record batch size, queue depth and cache use after each of `engine`'s steps.

    The load gauges are read when scraped: the last step's values while the engine has work,
    0 once it has none. The engine observes a step before it releases the rows that step
    finished, and runs no step when idle, so a stored value would stay at the last request's
    load forever (two gauges read non-zero on an idle server, issue 37).
    """
    engine.on_step = _observe_step
    ADAPTERS.watch(engine)
    for gauge, key in (
        (QUEUE_DEPTH, "queue"),
        (RUNNING_ROWS, "rows"),
        (KV_CACHE_ROWS_USAGE, "kv_rows"),
        (KV_CACHE_TOKENS_USAGE, "kv_tokens"),
    ):
        gauge.set_function(lambda key=key: _last_step[key] if engine.has_work() else 0.0)
    pool = engine.pool
    _prefix_seen.update(queried=0, hit=0)
    if isinstance(pool, PagedPool):
        _prefix_seen.update(
            queried=pool.blocks.stats.queried_tokens, hit=pool.blocks.stats.hit_tokens
        )
        total = pool.blocks.num_blocks
        KV_BLOCKS_USED.set_function(lambda: _last_step["blocks_used"] if engine.has_work() else 0.0)
        KV_BLOCKS_FREE.set_function(
            lambda: total - _last_step["blocks_used"] if engine.has_work() else total
        )


async def metered(
    front: AsyncEngine,
    prompt_ids: list[int],
    config: SamplingConfig,
    protocol: str,
    *,
    hold: bool = False,
    adapter: str = "",
) -> AsyncIterator[StepEvent]:
    """`front.stream(prompt_ids, config, hold=hold, adapter=adapter)`, measured (see the module
    docstring);
    latencies use the time the engine handed each event over, so held events count too."""
    PROMPT_TOKENS.inc(len(prompt_ids))
    start = last = time.perf_counter()
    first = True
    finish = "cancelled"
    refused = False  # an unknown adapter: never served, so never a label value
    try:
        async for event in front.stream(prompt_ids, config, hold=hold, adapter=adapter):
            if event.token_ids:
                GENERATED_TOKENS.inc(len(event.token_ids))
                if adapter:
                    ADAPTERS.generated(adapter, len(event.token_ids))
                if event.index == 0:
                    now = event.time_s or time.perf_counter()
                    if first:
                        TIME_TO_FIRST_TOKEN.observe(now - start)
                        if adapter:
                            ADAPTERS.first_token(adapter, now - start)
                        first = False
                    else:
                        INTER_TOKEN_LATENCY.observe(now - last)
                    last = now
            if event.finish is not None and event.index == 0:
                finish = event.finish.value
            yield event
    except InvalidRequest:
        refused = True
        raise
    finally:
        REQUESTS.labels(protocol, finish).inc()
        if adapter and not refused:
            ADAPTERS.finished(adapter, len(prompt_ids), finish)
