"""Tokeniser worker processes with ordered, bounded output.

The main process reads records and hands them out in chunks; each worker builds its own tokenizer
and handler once (from a picklable `WorkerSpec`) and returns token arrays per record. Results come
back in input order whatever the worker count, so `--workers 2` writes byte-identical shards to
`--workers 1`. At most `window` chunks are in flight, which bounds memory: the reader is only
advanced as fast as the workers drain it. Workers start with "spawn" (safe next to gRPC threads
and independent of what the parent imported); a worker that dies raises `BrokenProcessPool`
instead of hanging the run.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.tokenizer import build_tokenizer
from services.common.job_processes import die_with_parent_here
from services.preprocess.handlers import Handler, HandlerOptions, RecordError, get_handler_class
from services.preprocess.readers import Record


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to rebuild the tokenizer and handler."""

    tokenizer_type: str
    """"SentencePiece" or "PretrainedFromHF"."""
    tokenizer_path: str
    """The .model file or the HF tokenizer directory."""
    use_fast: bool
    """HF only: load the fast (Rust) tokenizer."""
    handler_name: str
    """Registry name, alias or module:Class of the handler."""
    options: HandlerOptions
    """Options passed to the handler."""


@dataclass
class Outcome:
    """One record after tokenisation: arrays per output key, or why it was rejected."""

    location: str
    """Where the record came from (file:line)."""
    arrays: dict[str, np.ndarray] | None
    """int32 token ids per output key (None when rejected or dropped)."""
    error: str | None = None
    """Why the record is bad (None otherwise)."""


def build_handler(spec: WorkerSpec) -> Handler:
    """The handler described by `spec`, with its tokenizer loaded."""
    tokenizer = build_tokenizer(spec.tokenizer_type, spec.tokenizer_path, use_fast=spec.use_fast)
    return get_handler_class(spec.handler_name)(tokenizer, spec.options)


def process_chunk(handler: Handler, chunk: list[Record]) -> list[Outcome]:
    """Tokenise one chunk of records, keeping their order and locations."""
    good = [record for record in chunk if record.error is None]
    results = iter(handler.process_batch([record.data for record in good]))  # type: ignore[misc]
    outcomes = []
    for record in chunk:
        if record.error is not None:
            outcomes.append(Outcome(record.location, None, record.error))
            continue
        result = next(results)
        if isinstance(result, RecordError):
            outcomes.append(Outcome(record.location, None, str(result)))
        elif result is None:
            outcomes.append(Outcome(record.location, None))
        else:
            arrays = {key: np.asarray(ids, dtype=np.int32) for key, ids in result.items()}
            outcomes.append(Outcome(record.location, arrays))
    return outcomes


_WORKER_HANDLER: Handler | None = None


def _worker_init(spec: WorkerSpec, parent: int) -> None:
    global _WORKER_HANDLER
    # A worker blocks on the task queue forever once its service is killed (every worker holds
    # the queue's write end too): it must die with the process that started it.
    if not die_with_parent_here(parent, signal.SIGKILL):
        os._exit(1)
    # Parallelism comes from the processes; Rust's per-process thread pool would oversubscribe.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_HANDLER = build_handler(spec)


def _worker_run(chunk: list[Record]) -> list[Outcome]:
    assert _WORKER_HANDLER is not None, "worker used before its initializer ran"
    return process_chunk(_WORKER_HANDLER, chunk)


class OrderedWorkers:
    """Runs chunks through `workers` processes (or inline for 1) and yields results in order."""

    def __init__(self, spec: WorkerSpec, workers: int, window: int | None = None) -> None:
        self.spec = spec
        self.workers = workers
        self.window = window or 2 * workers
        self._pool: ProcessPoolExecutor | None = None
        self._inline: Handler | None = None

    def __enter__(self) -> OrderedWorkers:
        if self.workers <= 1:
            self._inline = build_handler(self.spec)
        else:
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(self.spec, os.getpid()),
            )
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(terminate=exc_type is not None)

    def close(self, terminate: bool = False) -> None:
        """Stop the workers (`terminate` drops queued chunks; running ones are small)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=terminate)
            self._pool = None

    def run(self, chunks: Iterable[list[Record]]) -> Iterator[list[Outcome]]:
        """Outcomes of each chunk, in input order, with at most `window` chunks in flight."""
        if self._inline is not None:
            for chunk in chunks:
                yield process_chunk(self._inline, chunk)
            return
        assert self._pool is not None, "use OrderedWorkers as a context manager"
        pending: deque[Future[list[Outcome]]] = deque()
        for chunk in chunks:
            pending.append(self._pool.submit(_worker_run, chunk))
            if len(pending) >= self.window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def chunked(records: Iterable[Record], size: int) -> Iterator[list[Record]]:
    """Consecutive lists of `size` records (the last may be shorter)."""
    chunk: list[Record] = []
    for record in records:
        chunk.append(record)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
