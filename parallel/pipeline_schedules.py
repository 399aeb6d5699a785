"""The pipeline schedule registry: --pipeline-schedule string -> torch schedule and placement.

A schedule runs one stage per pipeline rank ("single"), or several chunks per rank placed
"looped" (stage c·P + r on rank r, any number of chunks) or "v" (exactly 2 chunks per rank:
rank r runs stages r and 2P-1-r, so the first and last stage share rank 0). Adding a schedule is
one entry in `SCHEDULES`; the CLI choices (`training.run_sections`) list the same keys
(a test checks they agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

Placement = Literal["single", "looped", "v"]


@dataclass(frozen=True)
class PipelineSchedule:
    """One --pipeline-schedule choice."""

    name: str
    """The CLI string (--pipeline-schedule)."""
    schedule_class: Any
    """The `torch.distributed.pipelining` schedule class."""
    placement: Placement
    """How a rank's stage chunks are placed: single, looped or v (see the module docstring)."""

    @property
    def multi_stage(self) -> bool:
        """Takes a list of stages per rank (virtual pipelining), not one stage."""
        return self.placement != "single"

    @property
    def v_shaped(self) -> bool:
        """Places a rank's two chunks in a V (rank r: stages r and 2P-1-r)."""
        return self.placement == "v"


SCHEDULES: dict[str, PipelineSchedule] = {
    s.name: s
    for s in (
        PipelineSchedule("1f1b", Schedule1F1B, "single"),
        PipelineSchedule("gpipe", ScheduleGPipe, "single"),
        PipelineSchedule("interleaved_1f1b", ScheduleInterleaved1F1B, "looped"),
        PipelineSchedule("looped_bfs", ScheduleLoopedBFS, "looped"),
        PipelineSchedule("interleaved_zero_bubble", ScheduleInterleavedZeroBubble, "looped"),
        PipelineSchedule("zbv", ScheduleZBVZeroBubble, "v"),
        PipelineSchedule("dualpipev", ScheduleDualPipeV, "v"),
    )
}


def get_schedule(name: str) -> PipelineSchedule:
    """The schedule called `name`; ValueError naming the choices otherwise."""
    if name not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule must be one of {tuple(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name]


def default_schedule(virtual: int) -> str:
    """1F1B without virtual chunks, interleaved 1F1B with them."""
    return "1f1b" if virtual == 1 else "interleaved_1f1b"
