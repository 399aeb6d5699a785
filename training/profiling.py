"""`--profile`: the torch profiler around a window of training steps, as Megatron-LM and MindSpeed.

Steps are counted like `TrainState.step`, the steps done before the one about to run, so with
`--profile-step-start 10 --profile-step-end 12` the profiler starts before step 9 (its warm-up,
recorded and discarded), records steps 10 and 11 (the log's steps 11 and 12) and writes one trace
per profiled rank when step 11 ends, or when the run ends inside the window.

- CPU and CUDA: a Chrome trace `rank{R}.steps{S}-{E}.pt.trace.json` (Perfetto, chrome://tracing
  and TensorBoard's profiler plugin read it) and one log line naming the operators that took the
  most time. On CUDA the recorded steps are also a cudaProfilerApi range, so
  `nsys profile --capture-range=cudaProfilerApi` captures the same steps (Megatron's default).
- Ascend: torch_npu's profiler at --profile-level, written by its own handler
  (`kernels.npu.profiler`), as MindSpeed's `--profile` writes it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from checkpoints.safe_fs import open_dir_beneath
from kernels.device import Platform
from training.run_sections import RunSection

log = logging.getLogger(__name__)

TOP_OPS = 5
"""Operators named in the log line at the end of the window."""


class StepProfiler:
    """Starts, advances and stops the profiler of one rank around the steps of `run`'s window."""

    def __init__(self, run: RunSection, rank: int, platform: Platform) -> None:
        self.run, self.rank, self.platform = run, rank, platform
        self.device_type = platform.type
        self.enabled = run.profiles_rank(rank)
        self.start, self.end = run.profile_step_start, run.profile_step_end
        self.save_dir = Path(run.profile_dir())
        self.trace_path: Path | None = None
        """The Chrome trace written (CPU and CUDA runs), once the window has ended."""
        self._prof: Any = None
        self._first = self._last = -1  # the recorded steps
        self._done = False

    def check_start(self, step: int) -> None:
        """Warn when a run that starts at `step` (resumed) is past the window (`before_step`
        then never finds a step in it)."""
        if self.enabled and step >= self.end:
            log.warning(
                "--profile: the run starts at step %d, at or after --profile-step-end %d: "
                "nothing is profiled (move the window past the loaded step)",
                step,
                self.end,
            )

    def before_step(self, step: int) -> None:
        """Start the profiler when the step about to run (`step` done) opens the window, or
        advance it to this step."""
        if not self.enabled or self._done:
            return
        if self._prof is not None:
            self._prof.step()  # the trace's ProfilerStep# mark for this step starts here
        elif step == self.start - 1 or self.start <= step < self.end:
            warmup = 1 if step == self.start - 1 else 0
            self._first = step + warmup
            # Opened beneath the data root now; the trace is written through this descriptor.
            self._dir = open_dir_beneath(self.save_dir, create=True)
            self._prof = self._build(warmup, self.end - self._first)
            self._prof.start()
        else:
            return
        if step == self._first:
            self.platform.capture_range(start=True)

    def after_step(self, step: int) -> None:
        """Note the step that just ran (`step` are done now); the window's last one stops it."""
        if self._prof is None:
            return
        if step - 1 >= self._first:
            self._last = step - 1
        if step >= self.end:
            self.close()

    def close(self) -> None:
        """Stop a running profiler and write its trace (the window ended, or the run did)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        self._done = True
        self.platform.capture_range(start=False)
        started = time.perf_counter()
        prof.stop()
        with self._dir:
            self._finish(prof, started)

    def _finish(self, prof: Any, started: float) -> None:
        if self._last < self._first:
            log.warning(
                "--profile: the run ended before the log's step %d; no trace", self._first + 1
            )
            return
        if self.device_type == "npu":
            log.info(
                "profile of rank %d, the log's steps %d-%d: written to %s by torch_npu (%.1f s; "
                "open it in MindStudio Insight)",
                self.rank,
                self._first + 1,
                self._last + 1,
                self.save_dir,
                time.perf_counter() - started,
            )
            return
        self._write(prof)

    def _build(self, warmup: int, active: int) -> Any:
        run = self.run
        if self.device_type == "npu":
            # NPU only: kernels.npu imports torch_npu
            from kernels.npu.profiler import npu_profile

            return npu_profile(
                str(self.save_dir),
                warmup=warmup,
                active=active,
                level=run.profile_level,
                with_cpu=run.profile_with_cpu,
                record_shapes=run.profile_record_shapes,
                profile_memory=run.profile_with_memory,
                with_stack=run.profile_with_stack,
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            # A window that starts at step 0 has no step to warm up on.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            window = torch.profiler.schedule(wait=0, warmup=warmup, active=active + 1)
        # Numbered as the log numbers steps, so the trace's ProfilerStep#N is the log's step N.
        offset = self._first + 1 - warmup
        prof = torch.profiler.profile(
            activities=activities,
            schedule=lambda n: window(max(n - offset, 0)),  # built at step 0: the first action
            record_shapes=run.profile_record_shapes,
            profile_memory=run.profile_with_memory,
            with_stack=run.profile_with_stack,
        )
        prof.step_num = offset
        return prof

    def _write(self, prof: Any) -> None:
        steps = f"{self._first + 1}-{self._last + 1}"  # as the log numbers them
        path = self.save_dir / f"rank{self.rank}.steps{steps}.pt.trace.json"
        # The profiler writes by path: to a private temporary folder, copied from there through
        # the folder opened beneath the data root (a swapped save dir redirects nothing).
        with tempfile.TemporaryDirectory(prefix="meshline-trace-") as private:
            prof.export_chrome_trace(os.path.join(private, path.name))
            source = os.path.join(private, path.name)
            with open(source, "rb") as src, self._dir.fdopen(path.name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        self.trace_path = path
        log.info(
            "profile of rank %d, the log's steps %d-%d: %s (open it in https://ui.perfetto.dev "
            "or TensorBoard); most time: %s",
            self.rank,
            self._first + 1,
            self._last + 1,
            path,
            top_ops(prof, self.device_type),
        )


def top_ops(prof: Any, device_type: str, count: int = TOP_OPS) -> str:
    """'name share%, ...' of the operators with the most self time (device time on CUDA)."""
    attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(getattr(e, attr) for e in events)
    if total <= 0:
        return "no operators recorded"
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return ", ".join(f"{e.key} {100 * getattr(e, attr) / total:.1f}%" for e in events[:count])
