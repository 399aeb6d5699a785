"""What goes into and comes out of the engine: requests, per-step events, finished sequences."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling import SamplingConfig


class Finish(enum.Enum):
    """Why a sequence stopped (mirrors the proto's FinishReason)."""

    LENGTH = "length"
    STOP = "stop"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"


class RequestError(Exception):
    """One request failed inside the engine (while `stage`); only that request ends.

    The engine catches anything raised while it handles one request's part of a batched step,
    drops that request's rows and reports this error to it; the other requests go on.
    """

    def __init__(self, request_id: int, stage: str, cause: BaseException) -> None:
        super().__init__(
            f"request {request_id} failed while {stage}: {type(cause).__name__}: {cause}"
        )
        self.request_id = request_id
        self.stage = stage
        self.cause = cause


@dataclass
class GenerationRequest:
    """One Generate call: prompt token ids and its decoding settings."""

    request_id: int
    prompt_ids: list[int]
    config: SamplingConfig
    adapter: int = 0
    """LoRA slot its rows compute with (engine/lora_adapters.py); 0: the base model."""


@dataclass
class StepEvent:
    """New tokens of one sequence of one request (the last event of a sequence has `finish`)."""

    request_id: int
    index: int
    token_ids: list[int]
    text: str
    cumulative_logprob: float
    seed: int
    finish: Finish | None = None
    error: RequestError | None = None
    """Set on the one event of a request that failed in the engine (it gets no other events)."""
    token_logprobs: list[float] = field(default_factory=list)
    """With SamplingConfig.logprobs: log-probability of each of `token_ids`."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """With SamplingConfig.logprobs: per token, the most likely (id, log-prob) at its position."""
    time_s: float = 0.0
    """`time.perf_counter()` when the engine thread handed this step's events over (0: never
    handed over), so latency metrics do not depend on when the event loop saw them."""


@dataclass
class SequenceResult:
    """A finished sequence: new tokens (EOS included when produced), text, reason, log-prob."""

    token_ids: list[int]
    text: str
    finish: Finish
    cumulative_logprob: float
    seed: int


@dataclass
class ScoreResult:
    """Log-probabilities of one continuation after its context."""

    logprob: float
    is_greedy: bool
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per continuation token, the most likely (id, log-prob) at its position (when asked)."""


def collect(events: list[StepEvent], num_sequences: int) -> list[SequenceResult]:
    """Fold a request's events into one result per sequence (index order)."""
    tokens: list[list[int]] = [[] for _ in range(num_sequences)]
    texts = [""] * num_sequences
    results: list[SequenceResult | None] = [None] * num_sequences
    for event in events:
        if event.error is not None:
            raise event.error
        tokens[event.index].extend(event.token_ids)
        texts[event.index] += event.text
        if event.finish is not None:
            results[event.index] = SequenceResult(
                tokens[event.index],
                texts[event.index],
                event.finish,
                event.cumulative_logprob,
                event.seed,
            )
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"collect: sequences {missing} have no final event")
    return [r for r in results if r is not None]
