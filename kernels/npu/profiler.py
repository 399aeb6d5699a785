"""torch_npu's profiler (`torch_npu.profiler.profile`) for Ascend NPUs, as `--profile` uses it."""

from __future__ import annotations

from typing import Any

import torch_npu  # registers torch.npu and its profiler on import

LEVELS = {"level0": "Level0", "level1": "Level1", "level2": "Level2"}


def npu_profile(
    save_dir: str,
    *,
    warmup: int,
    active: int,
    level: str,
    with_cpu: bool,
    record_shapes: bool,
    profile_memory: bool,
    with_stack: bool,
) -> Any:
    """A torch_npu profile of `warmup` discarded then `active` recorded steps (advanced by its
    `step()`), writing into `save_dir` as MindSpeed's traces (MindStudio Insight reads them)."""
    prof = torch_npu.profiler
    activities = [prof.ProfilerActivity.NPU]
    if with_cpu:
        activities.append(prof.ProfilerActivity.CPU)
    experimental = prof._ExperimentalConfig(
        profiler_level=getattr(prof.ProfilerLevel, LEVELS[level]),
        aic_metrics=prof.AiCMetrics.PipeUtilization,
    )
    return prof.profile(
        activities=activities,
        schedule=prof.schedule(wait=0, warmup=warmup, active=active, repeat=1),
        on_trace_ready=prof.tensorboard_trace_handler(save_dir),
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
        experimental_config=experimental,
    )
