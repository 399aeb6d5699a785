"""The pipeline schedule registry: one table keyed by the --pipeline-schedule strings."""

from __future__ import annotations

import typing

import pytest

from parallel.pipeline_schedules import SCHEDULES, default_schedule, get_schedule
from training.run_sections import ParallelSection


def _literal_choices(annotation: object) -> set[str]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return set(args)
    return set().union(*(_literal_choices(a) for a in args)) if args else set()


def test_cli_choices_are_the_registry_keys():
    hints = typing.get_type_hints(ParallelSection)
    assert _literal_choices(hints["pipeline_schedule"]) == set(SCHEDULES)


def test_placements_keep_the_schedules_behaviour():
    single = {n for n, s in SCHEDULES.items() if not s.multi_stage}
    v_shaped = {n for n, s in SCHEDULES.items() if s.v_shaped}
    assert single == {"1f1b", "gpipe"}
    assert v_shaped == {"zbv", "dualpipev"}
    for name, schedule in SCHEDULES.items():
        assert schedule.name == name
        # torch's multi-stage schedules take a list of stages, the others one stage.
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        assert issubclass(schedule.schedule_class, PipelineScheduleMulti) == schedule.multi_stage
    assert (default_schedule(1), default_schedule(2)) == ("1f1b", "interleaved_1f1b")


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match=r"--pipeline-schedule must be one of .*'1f1b'.*got 'x'"):
        get_schedule("x")
