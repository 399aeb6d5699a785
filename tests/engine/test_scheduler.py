"""engine.scheduler: first come, first served admission by cache rows; cancellation of waiting
requests; the decode path follows the engine's declared capability, not its methods."""

from __future__ import annotations

from engine.requests import GenerationRequest
from engine.sampling import SamplingConfig
from engine.scheduler import Scheduler


def _request(rid: int, **fields) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2], SamplingConfig(**fields))


def test_admission_in_order_while_rows_fit_and_a_wide_request_blocks():
    scheduler = Scheduler()
    scheduler.add(
        [
            _request(1),
            _request(2, num_beams=3, num_return_sequences=2),
            _request(3, do_sample=True, num_return_sequences=2),
            _request(4),
        ]
    )
    assert [(r.request_id, n) for r, n in scheduler.admit(3)] == [(1, 1)]  # beams need 3
    assert len(scheduler) == 3
    assert [(r.request_id, n) for r, n in scheduler.admit(6)] == [(2, 3), (3, 2), (4, 1)]
    assert len(scheduler) == 0


def test_drop_removes_only_the_cancelled_waiting_requests():
    scheduler = Scheduler()
    scheduler.add([_request(1), _request(2), _request(3)])
    assert [r.request_id for r in scheduler.drop({2, 9})] == [2]
    assert scheduler.waiting_ids() == {1, 3}
    scheduler.clear()
    assert scheduler.admit(10) == []


def test_pipeline_stage_engine_declares_its_own_forward():
    from engine.engine import Engine
    from engine.pipeline_engine import PipelineEngine

    assert PipelineEngine.runs_own_forward and not Engine.runs_own_forward
