"""The job lifecycle every job service shares: claim the output, run as an operation, release.

A job service (preprocess, trainer, converter, evaluator) validates a request, then hands the
job to its `JobRunner`, which

1. claims the job's output path, so two running jobs never write the same place (the second
   request is refused with ABORTED naming the field; a retry after the first ends succeeds);
2. creates the operation (PENDING, with the request as metadata) in the server's store;
3. runs the job in a worker thread (`operation_jobs.run_in_thread`), which reports progress
   through its `OperationHandle` and ends SUCCEEDED, FAILED or CANCELLED from how it returned;
4. releases the claim when the job is over — returned, raised, or cancelled before it started —
   before the final state is stored, so a client that sees the operation done may start again.

Output paths are resolved under the data roots before they are claimed
(`DataRootsConfig.resolve`), so two spellings of one directory are one claim. Claims live in the
server's memory: a restarted server has no running jobs (their records say FAILED UNAVAILABLE).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import Message

from meshline.common.v1 import operations_pb2
from services.common.errors import Conflict
from services.common.operation_jobs import OperationHandle, run_in_thread
from services.common.operations import OperationsStore

Job = Callable[[OperationHandle], Message | None]
"""A job: does the work, reports through the handle, returns the operation's response."""


def operation_id(name: str) -> str:
    """The id part of an operation name ("operations/convert-2f1c9a" → "convert-2f1c9a")."""
    return name.rsplit("/", 1)[-1]


class OutputClaims:
    """Output paths that running jobs write, one job per path. Thread-safe.

    Claims are counted, not a set: a path held twice (an operation-named default that another
    job happened to claim explicitly) stays claimed until both holders release it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed: Counter[Path] = Counter()

    def claim(self, path: Path, refusal: str) -> None:
        """Claims `path`; raises Conflict (ABORTED) with `refusal` if a running job holds it."""
        with self._lock:
            if self._claimed[path]:
                raise Conflict(refusal)
            self._claimed[path] += 1

    def hold(self, path: Path) -> None:
        """Claims `path` without checking (a path named after a new operation is new)."""
        with self._lock:
            self._claimed[path] += 1

    def release(self, path: Path) -> None:
        """Releases one hold on `path` (a no-op if it is not claimed)."""
        with self._lock:
            if self._claimed[path] > 1:
                self._claimed[path] -= 1
            else:
                self._claimed.pop(path, None)

    def __contains__(self, path: object) -> bool:
        with self._lock:
            return bool(self._claimed.get(path))  # type: ignore[call-overload]


class JobRunner:
    """Starts one service's jobs as operations of `kind` in `store`, one job per output path."""

    def __init__(self, store: OperationsStore, kind: str, *, job_noun: str = "job") -> None:
        self.store = store
        self.kind = kind
        self.job_noun = job_noun
        """What the refusal calls a running job ("conversion", "evaluation", ...)."""
        self.claims = OutputClaims()

    def refusal(self, field: str, path: Path, path_noun: str) -> str:
        """The ABORTED message for a second job writing `path` (named by request `field`)."""
        return (
            f"{field}: another running {self.job_noun} writes {str(path)!r}; wait for it "
            f"(WaitOperation) or choose another {path_noun}"
        )

    def start(
        self,
        metadata: Message,
        job: Job,
        *,
        output: Path | Callable[[str], Path] | None = None,
        field: str = "output",
        path_noun: str = "directory",
        on_created: Callable[[str], None] | None = None,
    ) -> operations_pb2.Operation:
        """Claims `output`, creates the operation, runs `job` in a thread; returns the operation.

        `output` is the resolved path the job writes (Conflict naming `field` if a running job
        writes it; `path_noun` says what to choose instead), or a function of the operation id
        for outputs named after the operation (claimed once the operation exists), or None for
        a job without one output path (a training run without --save). `on_created` is
        called with the operation's name before the job starts (to register what other RPCs
        look up by that name).
        """
        claimed: list[Path] = []
        if isinstance(output, Path):
            self.claims.claim(output, self.refusal(field, output, path_noun))
            claimed.append(output)
        try:
            handle = self.store.create(self.kind, metadata)
        except BaseException:
            self._release(claimed)
            raise
        if callable(output):
            named = output(operation_id(handle.name))
            self.claims.hold(named)
            claimed.append(named)
        try:
            if on_created is not None:
                on_created(handle.name)
            run_in_thread(self.store, handle, job, on_exit=lambda: self._release(claimed))
        except BaseException as exc:
            # No thread, so no on_exit: release here and do not leave the operation PENDING.
            self._release(claimed)
            handle.fail(grpc.StatusCode.INTERNAL, f"could not start the job: {exc}"[:1000])
            raise
        return self.store.get(handle.name)

    def _release(self, paths: list[Path]) -> None:
        for path in paths:
            self.claims.release(path)
