"""The scheduler: which waiting requests take cache rows at the next step.

Admission is first come, first served: the request at the head of the queue is admitted while
the pool has the rows it needs (one per beam, else one per returned sequence); a request that
does not fit blocks the ones behind it, so a wide beam request is never starved by narrow ones.
With the dense cache a row, once admitted, holds its slots to the end (--max-model-len slots
per row). With the paged cache (`admit_each`) the pool decides per request: admitted with its
admission blocks promised, wait (blocks short: it and the requests behind it wait) or skip for
now (its prompt's next block is being computed by an earlier request: the ones behind may go);
a running request the engine preempts when blocks run out comes back at the head of the queue
(`requeue`), ahead of every request that never ran, as vLLM's scheduler does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

from engine.requests import GenerationRequest
from engine.validation import rows_needed

Admitted = TypeVar("Admitted")


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

    def requeue(self, request: GenerationRequest) -> None:
        """Put a preempted request back at the head of the queue."""
        self.waiting.appendleft(request)

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

    def admit_each(
        self,
        admit: Callable[[GenerationRequest], Admitted | bool | None],
        room: Callable[[], bool],
    ) -> list[Admitted]:
        """Offer waiting requests, in order while `room()`, to `admit`: what it returns for each
        admitted one; None stops (that request keeps its place), False passes over it."""
        admitted: list[Admitted] = []
        passed: deque[GenerationRequest] = deque()
        while self.waiting and room():
            request = self.waiting.popleft()
            result = admit(request)
            if result is None:
                self.waiting.appendleft(request)
                break
            if result is False:
                passed.append(request)
                continue
            admitted.append(result)  # type: ignore[arg-type]
        self.waiting = passed + self.waiting
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
