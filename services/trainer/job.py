"""One training job of the trainer service: launch, follow its metrics, stop, report.

The servicer validates a request and creates the operation; `run_job` then runs the job in the
operation's worker thread: it launches the workers (torchrun locally, or Kubernetes workloads),
turns each metrics record into a StreamMetricsResponse and the operation's progress, forwards
cancellation and StopTraining to the workers, and builds the TrainingResult.
"""

from __future__ import annotations

import collections
import io
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from meshline.trainer.v1 import trainer_pb2
from services.common.errors import Cancelled
from services.common.operations import OperationHandle
from services.common.state_db import ProcessRecord
from services.trainer.k8s_launcher import select_launcher
from services.trainer.request_paths import PERMISSION_DENIED_TAG, argv_from_config
from services.trainer.train_config import TrainConfig

logger = logging.getLogger(__name__)


@dataclass
class TrainingRun:
    """Live state of one training job of this server process."""

    config: TrainConfig
    argv: list[str] = field(default_factory=list)
    """The flags the workers get: `config` as flags, its paths resolved under the data roots."""
    env: dict[str, str] = field(default_factory=dict)
    """The checked request environment plus what the service sets (never the raw request's)."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set to stop the workers at their next step (StopTraining or cancellation)."""
    stop_requested: bool = False
    """StopTraining was called (the result then says `stopped_early`)."""
    save_on_stop: bool = True
    """Whether the workers checkpoint to --save when stopped."""
    metrics: list[trainer_pb2.StreamMetricsResponse] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[trainer_pb2.StreamMetricsResponse]:
        """The metrics received so far (a copy, safe to iterate while the job runs)."""
        with self.lock:
            return list(self.metrics)

    def request_stop(self, save_checkpoint: bool) -> None:
        """Stop the workers at their next step, checkpointing first if `save_checkpoint`."""
        self.save_on_stop = save_checkpoint
        self.stop_requested = True
        self.stop.set()


_NO_SPACE = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")


def _is_notable(line: str) -> bool:
    return PERMISSION_DENIED_TAG in line or any(marker in line for marker in _NO_SPACE)


class _OutputTail(io.StringIO):
    """The job's console output: forwarded to the server log, the last lines kept for errors."""

    def __init__(self, name: str, keep: int = 20) -> None:
        super().__init__()
        self._name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.notable: list[str] = []
        """Lines that decide the job's status (a full disk, a refused path), however early."""

    def write(self, text: str) -> int:
        """Logs each line of `text` (the launcher writes whole lines)."""
        for line in text.splitlines():
            self.lines.append(line)
            if len(self.notable) < 5 and _is_notable(line):
                self.notable.append(line)
            logger.info("%s | %s", self._name, line)
        return len(text)


def metrics_message(
    record: dict, previous: trainer_pb2.StreamMetricsResponse | None, tokens_per_step: int
) -> trainer_pb2.StreamMetricsResponse:
    """One launcher metrics record (a log interval ending at `step`) as a stream message."""
    step = int(record["step"])
    steps = step - (previous.step if previous else 0)
    message = trainer_pb2.StreamMetricsResponse(
        step=step,
        loss=record["loss"],
        grad_norm=record["grad_norm"],
        lr=record["lr"],
        tokens_per_s=record["tokens_per_s"],
        tflops=record["tflops"],
        mfu=record["mfu"],
        mem_gb=record["mem_gb"],
        skipped=int(record["skipped"]),
        nan=int(record["nan"]),
        step_seconds=record["elapsed_s"] / max(steps, 1),
        consumed_tokens=(previous.consumed_tokens if previous else 0) + steps * tokens_per_step,
    )
    for name, value in _objective_metrics(record.get("objective")).items():
        message.objective_metrics[name] = value
    message.timestamp.GetCurrentTime()
    return message


MAX_OBJECTIVE_METRICS = 64
"""Objective quantities kept per message (the objectives log at most about 20)."""


def _objective_metrics(values: object) -> dict[str, float]:
    """The record's objective quantities: names of at most 64 characters, finite numbers."""
    if not isinstance(values, dict):
        return {}
    out: dict[str, float] = {}
    for name, value in values.items():
        if len(out) >= MAX_OBJECTIVE_METRICS:
            break
        named = isinstance(name, str) and 0 < len(name) <= 64
        if named and isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def _summary(
    metrics: list[trainer_pb2.StreamMetricsResponse], elapsed: float
) -> trainer_pb2.TrainingSummary:
    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    last = metrics[-1] if metrics else trainer_pb2.StreamMetricsResponse()
    return trainer_pb2.TrainingSummary(
        final_loss=last.loss,
        mean_tokens_per_s=mean([m.tokens_per_s for m in metrics]),
        mean_tflops=mean([m.tflops for m in metrics]),
        mean_mfu=mean([m.mfu for m in metrics]),
        peak_mem_gb=max((m.mem_gb for m in metrics), default=0.0),
        skipped_steps=last.skipped,
        nan_steps=last.nan,
        elapsed_seconds=elapsed,
    )


def latest_checkpoint(save: str | None) -> str:
    """`save/step-XXXXXX` named by the `latest` pointer, or "" when nothing was saved."""
    if not save:
        return ""
    pointer = Path(save) / "latest"
    text = pointer.read_text().strip() if pointer.is_file() else ""
    return str(Path(save) / f"step-{int(text):06d}") if text.isdigit() else ""


def failure_status(code: int, lines: list[str], config: TrainConfig) -> tuple[grpc.StatusCode, str]:
    """The status of a job whose workers exited with `code`, from their last output lines.

    A full disk is RESOURCE_EXHAUSTED and a path refused at use time PERMISSION_DENIED, each
    with the worker's own line; anything else ABORTED with the tail of the output.
    """
    for line in lines:
        if any(marker in line for marker in _NO_SPACE):
            where = config.run.save or config.run.log_dir or "the output directory"
            return (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no space left on device while writing under {where} (ENOSPC): {line.strip()}",
            )
        if PERMISSION_DENIED_TAG in line:
            return grpc.StatusCode.PERMISSION_DENIED, line.split(PERMISSION_DENIED_TAG, 1)[1]
    tail = " | ".join(lines)
    return (
        grpc.StatusCode.ABORTED,
        f"training exited with code {code}; last output: {tail[-800:]}",
    )


def run_job(
    launcher: str,
    request: trainer_pb2.StartTrainingRequest,
    run: TrainingRun,
    handle: OperationHandle,
    metadata: trainer_pb2.TrainingMetadata,
    nproc: int,
    nnodes: int,
    *,
    on_started: Callable[[ProcessRecord], None] | None = None,
    lock_fds: tuple[int, ...] = (),
) -> trainer_pb2.TrainingResult | None:
    """The operation's body: run the job to its end; None after `handle.fail`.

    `on_started` records the job's processes (so a restarted server can stop them); `lock_fds`
    are the output claim's lock files, which the local launcher's agent holds while it runs.
    """
    # In a cluster the job runs as Kubernetes workloads, else as local torchrun processes.
    launch = select_launcher(launcher, handle.name)
    config = run.config
    batch = config.batch.global_batch_size or config.batch.micro_batch_size * nproc * nnodes
    tokens_per_step = batch * config.model.seq_length
    started = time.monotonic()

    def on_metrics(record: dict) -> None:
        with run.lock:
            previous = run.metrics[-1] if run.metrics else None
            message = metrics_message(record, previous, tokens_per_step)
            run.metrics.append(message)
        metadata.current_step = message.step
        metadata.last_loss = message.loss
        handle.progress(
            message.step,
            total=config.run.train_iters,
            unit="steps",
            message=f"step {message.step}/{config.run.train_iters} loss {message.loss:.4f}",
            metadata=metadata,
        )

    def forward_cancel() -> None:
        while not run.stop.is_set():
            if handle.cancel_requested.wait(0.5):
                run.stop.set()

    threading.Thread(target=forward_cancel, daemon=True).start()
    output = _OutputTail(handle.name)
    code = launch(
        list(run.argv) or argv_from_config(config),
        nproc,
        nnodes=nnodes,
        max_restarts=request.max_restarts,
        on_metrics=on_metrics,
        stop_event=run.stop,
        env=dict(run.env),
        output=output,
        save_on_stop=lambda: run.save_on_stop,
        operation=handle.name,
        on_started=on_started,
        pass_fds=lock_fds,
    )
    if handle.cancel_requested.is_set():
        raise Cancelled(f"{handle.name} was cancelled")
    if code != 0:
        handle.fail(*failure_status(code, [*output.notable, *output.lines], config))
        return None
    metrics = run.snapshot()
    return trainer_pb2.TrainingResult(
        final_step=metrics[-1].step if metrics else 0,
        checkpoint_path=latest_checkpoint(config.run.save),
        summary=_summary(metrics, time.monotonic() - started),
        metrics_csv_path=(
            str(Path(config.run.log_dir) / "metrics.csv") if config.run.log_dir else ""
        ),
        tensorboard_dir=config.run.log_dir or "",
        stopped_early=run.stop_requested,
    )
