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
(`DataRootsConfig.resolve`), so two spellings of one directory are one claim. A job claims the set
of paths it writes, all or none (`claims.OutputClaims`: in memory, in the state database, and as
`flock`s next to the outputs, so claims hold across processes and pods sharing a volume). A
restarted server fails its predecessor's unfinished jobs (FAILED UNAVAILABLE) only after
stopping their processes, and only then releases their claims (`OperationsStore`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from google.protobuf.message import Message

from meshline.common.v1 import operations_pb2
from services.common.claims import OutputClaims
from services.common.errors import MeshlineError
from services.common.operation_jobs import OperationHandle, run_in_thread
from services.common.operations import OperationsStore

Job = Callable[[OperationHandle], Message | None]
"""A job: does the work, reports through the handle, returns the operation's response."""


def operation_id(name: str) -> str:
    """The id part of an operation name ("operations/convert-2f1c9a" → "convert-2f1c9a")."""
    return name.rsplit("/", 1)[-1]


class JobRunner:
    """Starts one service's jobs as operations of `kind` in `store`, one job per output path."""

    def __init__(self, store: OperationsStore, kind: str, *, job_noun: str = "job") -> None:
        self.store = store
        self.kind = kind
        self.job_noun = job_noun
        """What the refusal calls a running job ("conversion", "evaluation", ...)."""
        self.claims = OutputClaims(store.db)

    def refusal(self, field: str, path: Path, path_noun: str, holder: str) -> str:
        """The ABORTED message for a second job writing `path` (named by request `field`)."""
        return (
            f"{field}: another running {self.job_noun} ({holder}) writes {str(path)!r}; wait "
            f"for it (WaitOperation) or choose another {path_noun}"
        )

    def start(
        self,
        metadata: Message,
        job: Job,
        *,
        output: Path | Sequence[Path] | Callable[[str], Path] | None = None,
        field: str = "output",
        path_noun: str = "directory",
        on_created: Callable[[str], None] | None = None,
    ) -> operations_pb2.Operation:
        """Claims `output`, creates the operation, runs `job` in a thread; returns the operation.

        `output` is the resolved path the job writes, or every path it writes (Conflict naming
        `field` and the holding operation if a running job writes one of them; `path_noun` says
        what to choose instead), or a function of the operation id
        for outputs named after the operation (claimed once the operation exists), or None for
        a job without one output path (a training run without --save). `on_created` is
        called with the operation's name before the job starts (to register what other RPCs
        look up by that name).
        """
        name = self.store.new_name(self.kind)
        claimed: list[Path] = []
        if isinstance(output, Path | list | tuple):
            paths = [output] if isinstance(output, Path) else list(output)
            self.claims.claim(
                name, paths, lambda path, holder: self.refusal(field, path, path_noun, holder)
            )
            claimed += paths
        try:
            handle = self.store.create(self.kind, metadata, name=name)
        except BaseException:
            self._release(name, claimed)
            raise
        try:
            if callable(output):
                named = output(operation_id(handle.name))
                claimed.append(named)
                self.claims.hold(name, named)
            if on_created is not None:
                on_created(handle.name)
            run_in_thread(self.store, handle, job, on_exit=lambda: self._release(name, claimed))
        except BaseException as exc:
            # No thread, so no on_exit: release here and do not leave the operation PENDING.
            self._release(name, claimed)
            if isinstance(exc, MeshlineError):
                handle.fail(exc.code, exc.message)
            else:
                handle.fail(grpc.StatusCode.INTERNAL, f"could not start the job: {exc}"[:1000])
            raise
        return self.store.get(handle.name)

    def _release(self, name: str, paths: list[Path]) -> None:
        self.claims.release(name, paths)
