"""The scheduler: which waiting requests take cache rows at the next step.

Admission is first come, first served: the request at the head of the queue is admitted while
the pool has the rows it needs (one per beam, else one per returned sequence); a request that
does not fit blocks the ones behind it, so a wide beam request is never starved by narrow ones.
Running requests are never preempted: a row, once admitted, holds its slots to the end (the
dense cache reserves --max-model-len slots per row). With paged KV, admission will count free
blocks instead of rows, and preemption (recompute or swap, as vLLM's) will plug in here.
"""

from __future__ import annotations

from collections import deque

from engine.requests import GenerationRequest
from engine.validation import rows_needed


class Scheduler:
    """The queue of requests waiting for cache rows."""

    def __init__(self) -> None:
        self.waiting: deque[GenerationRequest] = deque()
        """Requests not yet admitted, oldest first."""

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, requests: list[GenerationRequest]) -> None:
        """Queue new requests behind the waiting ones."""
        self.waiting.extend(requests)

    def admit(self, free_rows: int) -> list[tuple[GenerationRequest, int]]:
        """Take waiting requests, in order, while their rows fit in `free_rows`; each with its
        row count."""
        admitted: list[tuple[GenerationRequest, int]] = []
        while self.waiting:
            rows = rows_needed(self.waiting[0].config)
            if rows > free_rows:
                break
            admitted.append((self.waiting.popleft(), rows))
            free_rows -= rows
        return admitted

    def drop(self, cancelled: set[int]) -> list[GenerationRequest]:
        """Remove waiting requests whose ids are in `cancelled`; returns them."""
        dropped = [r for r in self.waiting if r.request_id in cancelled]
        if dropped:
            self.waiting = deque(r for r in self.waiting if r.request_id not in cancelled)
        return dropped

    def waiting_ids(self) -> set[int]:
        """Ids of the waiting requests."""
        return {r.request_id for r in self.waiting}

    def clear(self) -> None:
        """Forget every waiting request."""
        self.waiting.clear()
