"""JobRunner (services/common/jobs.py): one job per output path, claims released however jobs end."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from meshline.common.v1 import operations_pb2
from services.common.data_roots import DataRootsConfig
from services.common.errors import Conflict, FailedPrecondition, PermissionDenied
from services.common.jobs import JobRunner, operation_id
from services.common.operation_jobs import OperationHandle, run_in_thread
from services.common.operations import OperationsStore

S = operations_pb2
METADATA = S.Progress(message="the request")


def _wait_done(store: OperationsStore, name: str, timeout_s: float = 10.0) -> S.Operation:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        operation = store.get(name)
        if operation.done:
            return operation
        time.sleep(0.01)
    raise AssertionError(f"{name} did not finish within {timeout_s}s: {store.get(name)}")


class GatedJob:
    """A job that runs until released, then returns, raises, or honours a cancellation."""

    def __init__(self, outcome: str = "succeed") -> None:
        self.outcome = outcome
        self.started = threading.Event()
        self.go = threading.Event()

    def __call__(self, handle: OperationHandle) -> S.Progress:
        self.started.set()
        while not self.go.wait(0.01):
            handle.check_cancelled()
        if self.outcome == "fail":
            raise FailedPrecondition("save_dir: the parity check failed")
        if self.outcome == "crash":
            raise RuntimeError("a bug in the job")
        return S.Progress(completed=1, unit="files")


def _start(runner: JobRunner, job: GatedJob, output: Path) -> str:
    operation = runner.start(METADATA, job, output=output, field="save_dir")
    assert job.started.wait(10), "the job thread did not start"
    return operation.name


def test_second_job_on_the_same_output_is_refused_with_aborted(tmp_path: Path) -> None:
    store = OperationsStore(None)
    runner = JobRunner(store, "convert", job_noun="conversion")
    out = tmp_path / "out"
    first = GatedJob()
    name = _start(runner, first, out)
    assert out in runner.claims

    with pytest.raises(Conflict) as refused:
        runner.start(METADATA, GatedJob(), output=out, field="save_dir")
    assert refused.value.code == grpc.StatusCode.ABORTED
    assert refused.value.message == (
        f"save_dir: another running conversion ({name}) writes {str(out)!r}; wait for it "
        "(WaitOperation) or choose another directory"
    )
    # The refused request created no operation; the first job is untouched.
    operations, _ = store.list()
    assert [op.name for op in operations] == [name]
    other = tmp_path / "other"
    second = GatedJob()
    other_name = _start(runner, second, other)  # a different output is not blocked

    first.go.set()
    second.go.set()
    assert _wait_done(store, name).state == S.OPERATION_STATE_SUCCEEDED
    assert _wait_done(store, other_name).state == S.OPERATION_STATE_SUCCEEDED


@pytest.mark.parametrize(
    ("outcome", "state", "code"),
    [
        ("succeed", S.OPERATION_STATE_SUCCEEDED, 0),
        ("fail", S.OPERATION_STATE_FAILED, grpc.StatusCode.FAILED_PRECONDITION.value[0]),
        ("crash", S.OPERATION_STATE_FAILED, grpc.StatusCode.INTERNAL.value[0]),
        ("cancel", S.OPERATION_STATE_CANCELLED, 0),
    ],
)
def test_claim_is_released_however_the_job_ends(
    tmp_path: Path, outcome: str, state: int, code: int
) -> None:
    store = OperationsStore(tmp_path / "state")
    runner = JobRunner(store, "preprocess")
    out = tmp_path / "data" / "wiki"
    job = GatedJob(outcome)
    name = _start(runner, job, out)
    with pytest.raises(Conflict):
        runner.start(METADATA, GatedJob(), output=out, field="output_prefix")
    if outcome == "cancel":
        store.cancel(name)
    else:
        job.go.set()
    operation = _wait_done(store, name)
    assert (operation.state, operation.error.code) == (state, code)
    # Released before the final state was stored: no sleep between "done" and reuse.
    assert out not in runner.claims
    again = GatedJob()
    again_name = _start(runner, again, out)
    again.go.set()
    assert _wait_done(store, again_name).state == S.OPERATION_STATE_SUCCEEDED


def test_cancelled_before_the_job_starts_still_releases(tmp_path: Path) -> None:
    store = OperationsStore(None)
    handle = store.create("convert", METADATA)
    handle.cancel_requested.set()  # e.g. the server began to stop before the thread ran
    ran, exited = [], threading.Event()
    thread = run_in_thread(store, handle, ran.append, on_exit=exited.set)
    thread.join(10)
    assert exited.is_set() and ran == []
    assert store.get(handle.name).state == S.OPERATION_STATE_CANCELLED


def test_a_failed_create_releases_the_claim(tmp_path: Path) -> None:
    runner = JobRunner(OperationsStore(None), "Not A Kind")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="operation kind"):
        runner.start(METADATA, GatedJob(), output=out, field="save_dir")
    assert out not in runner.claims


def test_output_named_after_the_operation_is_claimed_while_it_runs(tmp_path: Path) -> None:
    store = OperationsStore(None)
    runner = JobRunner(store, "evaluate", job_noun="evaluation")
    job = GatedJob()
    operation = runner.start(METADATA, job, output=lambda op_id: tmp_path / op_id)
    assert job.started.wait(10)
    named = tmp_path / operation_id(operation.name)
    assert operation_id(operation.name).startswith("evaluate-")
    with pytest.raises(Conflict, match="output_path: another running evaluation"):
        runner.start(METADATA, GatedJob(), output=named, field="output_path")
    job.go.set()
    _wait_done(store, operation.name)
    assert named not in runner.claims


def test_a_path_held_twice_stays_claimed_until_both_jobs_end(tmp_path: Path) -> None:
    # An operation-named output is held without a check; if a running job already claimed the
    # same path, the first job to end must not release the other's claim.
    store = OperationsStore(None)
    runner = JobRunner(store, "evaluate", job_noun="evaluation")
    path = tmp_path / "shared"
    first, second = GatedJob(), GatedJob()
    name_first = _start(runner, first, path)
    name_second = runner.start(METADATA, second, output=lambda op_id: path).name
    assert second.started.wait(10)
    first.go.set()
    _wait_done(store, name_first)
    assert path in runner.claims
    with pytest.raises(Conflict):
        runner.start(METADATA, GatedJob(), output=path, field="output_path")
    second.go.set()
    _wait_done(store, name_second)
    assert path not in runner.claims


def test_on_created_runs_before_the_job(tmp_path: Path) -> None:
    store = OperationsStore(None)
    runner = JobRunner(store, "train")
    seen: list[tuple[str, str]] = []

    def job(handle: OperationHandle) -> None:
        seen.append(("job", handle.name))

    operation = runner.start(METADATA, job, on_created=lambda name: seen.append(("created", name)))
    _wait_done(store, operation.name)
    assert seen == [("created", operation.name), ("job", operation.name)]


def test_claims_are_of_paths_resolved_under_the_data_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "ckpt").mkdir(parents=True)
    (root / "alias").symlink_to(root / "ckpt")
    (tmp_path / "outside").mkdir()
    config = DataRootsConfig(data_roots=(root,))
    runner = JobRunner(OperationsStore(None), "convert", job_noun="conversion")
    job = GatedJob()
    _start(runner, job, config.resolve(str(root / "ckpt" / ".." / "ckpt"), "save_dir"))
    # Another spelling of the same directory, through a symlink, is the same claim.
    with pytest.raises(Conflict):
        runner.start(METADATA, GatedJob(), output=config.resolve(str(root / "alias"), "save_dir"))
    with pytest.raises(PermissionDenied, match=r"save_dir: .* outside the allowed roots"):
        config.resolve(str(root / ".." / "outside"), "save_dir")
    job.go.set()


_HOLDER = """
import sys, threading, time
from pathlib import Path
from services.common.jobs import JobRunner
from services.common.operations import OperationsStore
from meshline.common.v1 import operations_pb2 as S

store = OperationsStore(Path(sys.argv[1]))
runner = JobRunner(store, "convert")
go = threading.Event()
op = runner.start(S.Progress(), lambda handle: go.wait(), output=Path(sys.argv[2]), field="save_dir")
print(op.name, flush=True)
time.sleep(600)
"""


def _holder(state: Path, out: Path) -> tuple[subprocess.Popen, str]:
    """A server-like process whose job claims `out` and never ends; returns it and the op name."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(state), str(out)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_claims_hold_across_processes_until_the_holder_dies(tmp_path: Path) -> None:
    state, out = tmp_path / "state", tmp_path / "out"
    proc, name = _holder(state, out)
    try:
        assert name.startswith("operations/convert-")
        # A second server over the same state dir, and one over its own: both refused.
        for other_state in (state, tmp_path / "other-state"):
            runner = JobRunner(OperationsStore(other_state), "convert", job_noun="conversion")
            with pytest.raises(Conflict, match="another running conversion") as refused:
                runner.start(METADATA, GatedJob(), output=out, field="save_dir")
            assert "writes" in refused.value.message
        # The live owner's operation is left alone by the second server over its directory.
        stored = {s.operation.name: s.operation for s in OperationsStore(state).db.operations()}
        assert not stored[name].done
    finally:
        proc.kill()
        proc.wait()
    # Killed with SIGKILL: the restarted server fails its job with the reason, and the claim
    # (database row and flock) is free.
    restarted = OperationsStore(state)
    record = restarted.get(name)
    assert (record.state, record.error.code) == (
        S.OPERATION_STATE_FAILED,
        grpc.StatusCode.UNAVAILABLE.value[0],
    )
    assert f"(pid {proc.pid}) ended before the job finished" in record.error.message
    assert restarted.db.claims() == {}
    runner = JobRunner(restarted, "convert")
    again = GatedJob()
    again_name = _start(runner, again, out)
    again.go.set()
    assert _wait_done(restarted, again_name).state == S.OPERATION_STATE_SUCCEEDED


def test_a_claim_of_a_path_set_is_all_or_none(tmp_path: Path) -> None:
    store = OperationsStore(None)
    runner = JobRunner(store, "preprocess")
    shard = tmp_path / "wiki-shard-00001-of-00002"
    job = GatedJob()
    _start(runner, job, shard)
    both = [tmp_path / "wiki-shard-00000-of-00002", shard]
    with pytest.raises(Conflict, match=str(shard)):
        runner.start(METADATA, GatedJob(), output=both, field="output_prefix")
    assert both[0] not in runner.claims, "a refused set holds none of its paths"
    # A claim also conflicts with one on an ancestor or descendant directory.
    parent_job = GatedJob()
    _start(runner, parent_job, tmp_path / "ckpt")
    with pytest.raises(Conflict):
        runner.start(METADATA, GatedJob(), output=tmp_path / "ckpt" / "sub", field="save_dir")
    job.go.set()
    parent_job.go.set()


def test_an_unlockable_named_output_fails_the_operation_it_created(tmp_path: Path) -> None:
    store = OperationsStore(None)
    runner = JobRunner(store, "evaluate", job_noun="evaluation")
    blocker = tmp_path / "root-is-a-file"
    blocker.write_text("")
    with pytest.raises(FailedPrecondition, match="cannot create the claim lock"):
        runner.start(METADATA, GatedJob(), output=lambda op_id: blocker / op_id)
    (operation,) = store.list()[0]
    assert operation.state == S.OPERATION_STATE_FAILED, "left PENDING forever"
    assert operation.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
