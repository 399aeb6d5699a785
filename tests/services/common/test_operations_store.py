"""OperationsStore and run_in_thread: lifecycle, rate/ETA, restart, watch order, wait, list."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path

import grpc
import pytest

from meshline.common.v1 import operations_pb2
from services.common.errors import InvalidArgument, NotFound
from services.common.operation_records import RECORD_FORMAT
from services.common.operations import OperationsStore, run_in_thread
from services.common.state_db import DB_NAME

S = operations_pb2


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _finish_in_time(thread: threading.Thread) -> None:
    thread.join(10)
    assert not thread.is_alive()


def test_lifecycle_progress_rate_eta_and_result() -> None:
    clock = FakeClock()
    store = OperationsStore(None, clock=clock)
    handle = store.create("train", metadata=S.Progress(message="request as accepted"))
    op = store.get(handle.name)
    assert op.name.startswith("operations/train-")
    assert (op.kind, op.state, op.done) == ("train", S.OPERATION_STATE_PENDING, False)
    assert op.metadata.Is(S.Progress.DESCRIPTOR)

    handle.start()
    assert store.get(handle.name).state == S.OPERATION_STATE_RUNNING
    handle.progress(10, total=100, unit="steps", message="step 10")
    first = store.get(handle.name).progress
    assert first.rate == 0 and not first.HasField("eta_seconds"), "one sample gives no rate yet"
    clock.now += 2.0
    handle.progress(30, message="step 30")
    progress = store.get(handle.name).progress
    assert progress.rate == pytest.approx(10.0)
    assert progress.eta_seconds == pytest.approx(7.0)
    assert (progress.total, progress.unit, progress.message) == (100, "steps", "step 30")

    assert handle.succeed(S.Progress(completed=100, unit="steps"))
    op = store.get(handle.name)
    assert (op.state, op.done) == (S.OPERATION_STATE_SUCCEEDED, True)
    result = S.Progress()
    assert op.response.Unpack(result) and result.completed == 100
    assert op.end_time.ToNanoseconds() >= op.create_time.ToNanoseconds() > 0
    assert not handle.fail(grpc.StatusCode.INTERNAL, "late"), "a finished operation stays finished"
    assert store.get(handle.name).state == S.OPERATION_STATE_SUCCEEDED


def test_fail_and_cancel() -> None:
    store = OperationsStore(None)
    failing = store.create("convert")
    failing.fail(grpc.StatusCode.NOT_FOUND, "checkpoint /x does not exist")
    op = store.get(failing.name)
    assert (op.state, op.error.code) == (
        S.OPERATION_STATE_FAILED,
        grpc.StatusCode.NOT_FOUND.value[0],
    )
    assert op.error.message == "checkpoint /x does not exist"

    job = store.create("train")
    job.start()
    assert store.cancel(job.name).state == S.OPERATION_STATE_RUNNING, (
        "the job decides when it stops"
    )
    assert job.cancel_requested.is_set()
    job.cancelled()
    assert store.get(job.name).state == S.OPERATION_STATE_CANCELLED
    assert store.cancel(job.name).state == S.OPERATION_STATE_CANCELLED, "idempotent once finished"
    with pytest.raises(NotFound, match="operations/nope"):
        store.cancel("operations/nope")
    with pytest.raises(ValueError, match="kind"):
        store.create("Bad Kind")


def test_run_in_thread_maps_how_the_job_ended() -> None:
    store = OperationsStore(None)

    def states(fn) -> operations_pb2.Operation:
        handle = store.create("job")
        _finish_in_time(run_in_thread(store, handle, fn))
        return store.get(handle.name)

    ok = states(lambda h: S.Progress(completed=1))
    assert ok.state == S.OPERATION_STATE_SUCCEEDED and ok.response.Is(S.Progress.DESCRIPTOR)

    def missing(h):
        raise NotFound("dataset /data/x does not exist")

    op = states(missing)
    assert (op.state, op.error.code) == (
        S.OPERATION_STATE_FAILED,
        grpc.StatusCode.NOT_FOUND.value[0],
    )

    def crash(h):
        raise RuntimeError("loss is NaN at step 7")

    op = states(crash)
    assert (op.state, op.error.code) == (
        S.OPERATION_STATE_FAILED,
        grpc.StatusCode.INTERNAL.value[0],
    )
    assert op.error.message == "RuntimeError: loss is NaN at step 7"


@pytest.mark.parametrize("style", ["check_cancelled", "return_early"])
def test_run_in_thread_honours_cancellation(style: str) -> None:
    store = OperationsStore(None)
    handle = store.create("train")
    looping = threading.Event()

    def job(h):
        for step in range(1000):
            looping.set()
            if style == "check_cancelled":
                h.check_cancelled()
            elif h.cancel_requested.is_set():
                return S.Progress(completed=step)
            h.progress(step, total=1000)
            time.sleep(0.005)
        return S.Progress(completed=1000)

    thread = run_in_thread(store, handle, job)
    assert looping.wait(5)
    store.cancel(handle.name)
    _finish_in_time(thread)
    op = store.get(handle.name)
    assert op.state == S.OPERATION_STATE_CANCELLED, "partial work must not look complete"
    assert not op.HasField("response")


def test_restarted_store_keeps_finished_and_fails_unfinished(tmp_path: Path) -> None:
    store = OperationsStore(tmp_path)
    done = store.create("train")
    done.succeed(S.Progress(completed=5, unit="steps"))
    running = store.create("train")
    running.start()
    pending = store.create("convert")
    assert (tmp_path / DB_NAME).is_file(), "one SQLite file under the state dir"

    restarted = OperationsStore(tmp_path)
    finished = restarted.get(done.name)
    assert finished.state == S.OPERATION_STATE_SUCCEEDED
    result = S.Progress()
    assert finished.response.Unpack(result) and result.completed == 5
    for handle, was in ((running, "RUNNING"), (pending, "PENDING")):
        op = restarted.get(handle.name)
        assert (op.state, op.done) == (S.OPERATION_STATE_FAILED, True)
        assert op.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert f"server restarted while the operation was OPERATION_STATE_{was}" in op.error.message
    assert len(restarted.list()[0]) == 3
    # The FAILED verdict was written back: a third start sees the same records.
    third = OperationsStore(tmp_path)
    assert third.get(running.name).error.message == restarted.get(running.name).error.message


def test_legacy_json_records_are_imported(tmp_path: Path) -> None:
    old = S.Operation(name="operations/train-0123456789ab", kind="train", done=True)
    old.state = S.OPERATION_STATE_SUCCEEDED
    old.create_time.GetCurrentTime()
    record = {
        "format": RECORD_FORMAT,
        "operation": None,
        "binary": base64.b64encode(old.SerializeToString()).decode("ascii"),
    }
    (tmp_path / "train-0123456789ab.json").write_text(json.dumps(record))
    (tmp_path / ".tmp-interrupted.json").write_text("{")
    (tmp_path / "garbage.json").write_text("not json")
    store = OperationsStore(tmp_path)
    assert store.get(old.name).state == S.OPERATION_STATE_SUCCEEDED
    assert not (tmp_path / ".tmp-interrupted.json").exists()
    assert OperationsStore(tmp_path).get(old.name).state == S.OPERATION_STATE_SUCCEEDED


def test_watch_yields_every_change_in_order() -> None:
    async def scenario() -> list[operations_pb2.Operation]:
        store = OperationsStore(None)
        handle = store.create("train")
        seen = []
        stream = store.watch(handle.name)
        seen.append(await stream.__anext__())

        def job() -> None:
            handle.start()
            for step in range(1, 51):
                handle.progress(step, total=50)
            handle.succeed()

        producer = threading.Thread(target=job)
        producer.start()
        seen += [op async for op in stream]
        producer.join()
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 20))
    states = [op.state for op in seen]
    assert states[0] == S.OPERATION_STATE_PENDING
    assert states[-1] == S.OPERATION_STATE_SUCCEEDED and seen[-1].done
    completed = [op.progress.completed for op in seen if op.state == S.OPERATION_STATE_RUNNING]
    assert completed == [0, *range(1, 51)], "start, then each progress update, in order"


def test_wait_times_out_then_returns_when_done() -> None:
    async def scenario() -> None:
        store = OperationsStore(None)
        handle = store.create("train")
        handle.start()
        started = time.monotonic()
        op = await store.wait(handle.name, timeout_s=0.2)
        assert 0.15 < time.monotonic() - started < 2
        assert op.state == S.OPERATION_STATE_RUNNING and not op.done
        asyncio.get_running_loop().call_later(0.1, handle.succeed)
        op = await store.wait(handle.name, timeout_s=None)
        assert op.state == S.OPERATION_STATE_SUCCEEDED
        assert (await store.wait(handle.name, timeout_s=0)).done
        with pytest.raises(InvalidArgument, match="timeout_seconds"):
            await store.wait(handle.name, timeout_s=-1)
        with pytest.raises(NotFound):
            await store.wait("operations/unknown", timeout_s=0)

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_list_filters_and_pages_newest_first() -> None:
    store = OperationsStore(None)
    names = []
    for i in range(8):
        handle = store.create("train" if i % 2 == 0 else "convert")
        names.append(handle.name)
        if i < 3:
            handle.succeed()
        time.sleep(0.001)
    newest_first = names[::-1]

    everything, token = store.list()
    assert [op.name for op in everything] == newest_first and token == ""
    trains, _ = store.list(kind="train")
    assert [op.name for op in trains] == [n for n in newest_first if "/train-" in n]
    succeeded, _ = store.list(state=S.OPERATION_STATE_SUCCEEDED)
    assert {op.name for op in succeeded} == set(names[:3])
    pending_trains, _ = store.list(kind="train", state=S.OPERATION_STATE_PENDING)
    assert [op.name for op in pending_trains] == [names[6], names[4]]

    paged, token = [], ""
    while True:
        page, token = store.list(page_size=3, page_token=token)
        assert len(page) <= 3
        paged += [op.name for op in page]
        if not token:
            break
    assert paged == newest_first

    with pytest.raises(InvalidArgument, match="page_token"):
        store.list(page_token="bm90LWEtdG9rZW4")
    with pytest.raises(InvalidArgument, match="page_size"):
        store.list(page_size=-1)


def test_shutdown_cancels_jobs_and_fails_the_ones_that_do_not_stop(tmp_path: Path) -> None:
    store = OperationsStore(tmp_path)
    polite, stubborn = store.create("train"), store.create("train")
    release = threading.Event()

    def honours(h):
        while True:
            h.check_cancelled()
            time.sleep(0.01)

    def ignores(h):
        release.wait(10)

    threads = [run_in_thread(store, polite, honours), run_in_thread(store, stubborn, ignores)]
    store.shutdown(timeout_s=0.5)
    assert store.get(polite.name).state == S.OPERATION_STATE_CANCELLED
    op = store.get(stubborn.name)
    assert op.state == S.OPERATION_STATE_FAILED and "server stopped" in op.error.message
    release.set()
    for thread in threads:
        _finish_in_time(thread)
    assert OperationsStore(tmp_path).get(stubborn.name).state == S.OPERATION_STATE_FAILED
