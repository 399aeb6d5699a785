"""Autotuning that measures: short trials of a run's layout knobs, the fastest that fits wins.

DeepSpeed's autotuner (its `autotuning` block) runs a few steps of candidate configurations and
keeps the one with the best measured throughput. Here the search space is the micro-batch size,
the ZeRO stage and activation recompute (`AutotuneSection`); `plan` lays it out as a grid in run
order (ZeRO stage, then recompute, then growing micro-batches), `tune` runs each point as a
fresh job through the caller's `run_trial` (the trainer service launches `meshline train`'s own
workers), reads the trial's metrics.csv and keeps the measured tokens/s per device over the
steps after the warm-up. A trial is rejected when it fails (an out-of-memory kill included),
runs past its timeout or peaks above --autotune-memory-limit; once a micro-batch size is
rejected, larger ones with the same stage and recompute are not tried. The pick is the argmax
of the measured throughputs; `apply` gives the run's config with the picked knobs.

With --global-batch-size given, the global batch is held and only micro-batch sizes that divide
it per data-parallel rank are tried (the accumulation steps follow); without it the global batch
follows the micro-batch (micro x data-parallel size), as DeepSpeed's autotuner sets
train_batch_size from the micro-batch it tunes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar, cast

from training.autotune_section import AutotuneSection
from training.config import TrainingConfig
from training.metrics import read_csv

C = TypeVar("C", bound=TrainingConfig)
Status = Literal["ok", "over memory", "failed", "timed out", "invalid", "skipped", "not run"]
ZeroStage = Literal[0, 1, 2, 3]
Granularity = Literal["full", "selective"]
DEFAULT_MAX_MICRO_BATCH = 8
"""Largest micro-batch size tried when neither the flag nor a global batch bounds it."""


@dataclass(frozen=True)
class Trial:
    """One point of the search space."""

    micro_batch_size: int
    """--micro-batch-size of the trial."""
    zero_stage: int
    """--zero-stage of the trial."""
    recompute: str
    """none, selective or full (--recompute-granularity)."""

    def flags(self) -> str:
        """The trial's settings as `meshline train` flags."""
        text = f"--micro-batch-size {self.micro_batch_size} --zero-stage {self.zero_stage}"
        if self.recompute != "none":
            text += f" --recompute-granularity {self.recompute}"
        return text


@dataclass
class TrialRun:
    """What running one trial job gave (`run_trial`'s answer)."""

    returncode: int
    """The job's exit code (0: it finished its steps)."""
    timed_out: bool = False
    """The job was stopped at --autotune-trial-timeout."""


@dataclass
class TrialResult:
    """One trial's outcome."""

    trial: Trial
    """The settings tried."""
    status: Status
    """ok, or why it was rejected (over memory, failed, timed out, invalid) or not run."""
    tokens_per_s: float | None = None
    """Measured tokens/s per device over the steps after the warm-up (ok and over memory)."""
    peak_bytes: int | None = None
    """Peak memory of rank 0 over the trial (device peak; the resident set on a CPU run)."""
    seconds: float = 0.0
    """Wall time of the trial, start-up included."""
    note: str = ""
    """Why it was rejected, or where its files are."""


@dataclass
class AutotuneResult:
    """Every trial, and the fastest accepted one."""

    trials: list[TrialResult] = field(default_factory=list)
    """In run order, rejected and not-run points included."""
    best: TrialResult | None = None
    """The accepted trial with the highest measured tokens/s (None: none was accepted)."""


RunTrial = Callable[[TrainingConfig, Path, float], TrialRun]
"""(trial config, its directory, timeout in seconds) -> how the trial job ended."""


def micro_batch_sizes(config: TrainingConfig, world_size: int) -> list[int]:
    """The micro-batch sizes to try: powers of two times the smallest up to the largest that the
    global batch allows, at most --autotune-num-micro-batch-sizes spread evenly."""
    section = config.autotune
    dp = config.dp_size(world_size)
    gbs = config.batch.global_batch_size
    top = section.autotune_max_micro_batch_size
    if top is None:
        top = gbs // dp if gbs is not None else DEFAULT_MAX_MICRO_BATCH
    sizes = []
    size = section.autotune_min_micro_batch_size
    while size <= top:
        if gbs is None or gbs % (size * dp) == 0:
            sizes.append(size)
        size *= 2
    count = section.autotune_num_micro_batch_sizes
    if len(sizes) > count:
        if count == 1:
            return [sizes[-1]]
        picks = sorted({round(i * (len(sizes) - 1) / (count - 1)) for i in range(count)})
        sizes = [sizes[i] for i in picks]
    return sizes


def _recompute_of(config: TrainingConfig) -> str:
    return config.parallel.recompute_granularity or "none"


def plan(config: TrainingConfig, world_size: int) -> list[Trial]:
    """The grid in run order: ZeRO stage, then recompute, then growing micro-batch size."""
    section = config.autotune
    stages = section.autotune_zero_stages
    if stages is None:
        several = config.dp_size(world_size) > 1
        stages = [0, 1, 2, 3] if several else [config.parallel.zero_stage]
    recomputes = section.autotune_recompute or [_recompute_of(config)]
    sizes = micro_batch_sizes(config, world_size)
    if not sizes:
        raise ValueError(
            f"--autotune: no micro-batch size from {section.autotune_min_micro_batch_size} up "
            f"to the largest divides --global-batch-size {config.batch.global_batch_size} per "
            f"data-parallel rank ({config.dp_size(world_size)}); change the bounds or the batch"
        )
    return [
        Trial(mbs, stage, recompute)
        for stage in dict.fromkeys(stages)
        for recompute in dict.fromkeys(recomputes)
        for mbs in sizes
    ]


def apply(config: C, trial: Trial) -> C:
    """`config` with the trial's knobs (and no autotuning): what the trial and the run use."""
    par = config.parallel
    keep_full = trial.recompute == "full" and par.recompute_granularity == "full"
    parallel = dataclasses.replace(
        par,
        zero_stage=cast(ZeroStage, trial.zero_stage),
        use_distributed_optimizer=False,
        recompute_granularity=(
            None if trial.recompute == "none" else cast(Granularity, trial.recompute)
        ),
        recompute_method=par.recompute_method if keep_full else None,
        recompute_num_layers=par.recompute_num_layers if keep_full else None,
    )
    batch = dataclasses.replace(config.batch, micro_batch_size=trial.micro_batch_size)
    return dataclasses.replace(config, parallel=parallel, batch=batch, autotune=AutotuneSection())


def trial_config(config: C, trial: Trial, directory: Path) -> C:
    """The short job of one trial: the knobs, warm-up + measured steps, metrics every step in
    `directory`; no evaluation, checkpoint, resume, profile or early exit."""
    section = config.autotune
    tuned = apply(config, trial)
    run = dataclasses.replace(
        tuned.run,
        train_iters=section.autotune_warmup_steps + section.autotune_steps,
        log_interval=1,
        log_dir=str(directory),
        eval_interval=0,
        save=None,
        save_interval=0,
        load=None,
        finetune=False,
        no_load_optim=False,
        no_load_rng=False,
        exit_on_missing_checkpoint=False,
        exit_interval=0,
        exit_duration_in_mins=0.0,
        profile=False,
    )
    return dataclasses.replace(tuned, run=run)


def measure(metrics_csv: Path, warmup: int, steps: int) -> tuple[float, int] | None:
    """(tokens/s per device over steps warmup+1 .. warmup+steps, peak bytes over the trial) from
    a trial's metrics.csv (one row a step), or None when it lacks those steps."""
    if not metrics_csv.is_file():
        return None
    columns = read_csv(metrics_csv)
    if not columns:
        return None
    rows = list(zip(columns["step"], columns["tokens_per_s"], columns["elapsed_s"], strict=True))
    measured = [(tps, sec) for step, tps, sec in rows if warmup < step <= warmup + steps]
    seconds = sum(sec for _, sec in measured)
    if len(measured) < steps or seconds <= 0:
        return None
    tokens = sum(tps * sec for tps, sec in measured)
    peak = int(max(columns["mem_gb"]) * 2**30)
    return tokens / seconds, peak


def _run_one(
    config: C,
    trial: Trial,
    world_size: int,
    directory: Path,
    run_trial: RunTrial,
) -> TrialResult:
    section = config.autotune
    try:
        job = trial_config(config, trial, directory)
        job.validate(world_size)
    except ValueError as exc:
        return TrialResult(trial, "invalid", note=str(exc))
    directory.mkdir(parents=True, exist_ok=True)
    # The metrics writer appends: rows of an earlier tuning in the same folder must not count.
    (directory / "metrics.csv").unlink(missing_ok=True)
    start = time.monotonic()
    ran = run_trial(job, directory, section.autotune_trial_timeout)
    seconds = time.monotonic() - start
    got = measure(directory / "metrics.csv", section.autotune_warmup_steps, section.autotune_steps)
    if ran.timed_out:
        note = f"stopped after --autotune-trial-timeout {section.autotune_trial_timeout:g} s"
        return TrialResult(trial, "timed out", seconds=seconds, note=note)
    if ran.returncode != 0 or got is None:
        note = f"exit code {ran.returncode}; log: {directory / 'trial.log'}"
        return TrialResult(trial, "failed", seconds=seconds, note=note)
    tokens_per_s, peak = got
    limit = section.memory_limit_bytes()
    if limit is not None and peak > limit:
        note = f"peak {peak / 2**20:.1f} MiB > --autotune-memory-limit {limit / 2**20:.1f} MiB"
        return TrialResult(trial, "over memory", tokens_per_s, peak, seconds, note)
    return TrialResult(trial, "ok", tokens_per_s, peak, seconds, str(directory))


def pick(trials: list[TrialResult]) -> TrialResult | None:
    """The accepted trial with the highest measured tokens/s (the first of equals)."""
    accepted = [t for t in trials if t.status == "ok" and t.tokens_per_s is not None]
    return max(accepted, key=lambda t: t.tokens_per_s or 0.0) if accepted else None


def tune(
    config: C,
    world_size: int,
    run_trial: RunTrial,
    directory: Path,
    report: Callable[[str], None] = print,
) -> AutotuneResult:
    """Run the grid of `plan` (bounded by --autotune-max-trials and --autotune-early-stopping),
    one trial job each in `directory/trial-NN`; returns every outcome and the pick."""
    section = config.autotune
    result = AutotuneResult()
    rejected: set[tuple[int, str]] = set()  # (stage, recompute) whose smaller mbs was rejected
    ran = since_best = 0
    best_tps = -math.inf
    stop_reason = ""
    for index, trial in enumerate(plan(config, world_size), start=1):
        series = (trial.zero_stage, trial.recompute)
        if stop_reason:
            result.trials.append(TrialResult(trial, "not run", note=stop_reason))
            continue
        if series in rejected:
            note = "a smaller micro-batch with this stage and recompute was rejected"
            result.trials.append(TrialResult(trial, "skipped", note=note))
            continue
        outcome = _run_one(config, trial, world_size, directory / f"trial-{index:02d}", run_trial)
        result.trials.append(outcome)
        if outcome.status == "invalid":
            report(f"autotune: trial {index} {trial.flags()}: invalid ({outcome.note})")
            continue
        ran += 1
        report(f"autotune: trial {index} {trial.flags()}: {_describe(outcome)}")
        if outcome.status != "ok":
            rejected.add(series)
        if outcome.status == "ok" and (outcome.tokens_per_s or 0.0) > best_tps:
            best_tps, since_best = outcome.tokens_per_s or 0.0, 0
        else:
            since_best += 1
        if ran >= section.autotune_max_trials:
            stop_reason = f"--autotune-max-trials {section.autotune_max_trials} reached"
        elif section.autotune_early_stopping and since_best >= section.autotune_early_stopping:
            stop_reason = (
                f"--autotune-early-stopping: {since_best} trials in a row did not beat the best"
            )
    result.best = pick(result.trials)
    return result


def run_points(
    points: list[tuple[C, Trial]],
    world_size: int,
    run_trial: RunTrial,
    directory: Path,
    report: Callable[[str], None] = print,
) -> AutotuneResult:
    """Run given points in order, each a trial job of its own config (its parallel layout may
    differ from the others') in `directory/trial-NN`, every one of them (no grid, skipping or
    early stop: the caller chose them); returns every outcome and the pick, the accepted trial
    of the highest `job_tokens_per_s`. `meshline estimate --auto --trial N` measures the
    analytic ranking's top layouts with it."""
    result = AutotuneResult()
    for index, (config, trial) in enumerate(points, start=1):
        outcome = _run_one(config, trial, world_size, directory / f"trial-{index:02d}", run_trial)
        result.trials.append(outcome)
        report(f"autotune: trial {index} {trial.flags()}: {_describe(outcome)}")
    accepted = [
        (job_tokens_per_s(t, world_size), i)
        for i, t in enumerate(result.trials)
        if t.status == "ok" and t.tokens_per_s is not None
    ]
    if accepted:
        # max over (rate, -index): the first of equals, as `pick`.
        result.best = result.trials[max(accepted, key=lambda a: (a[0], -a[1]))[1]]
    return result


def job_tokens_per_s(outcome: TrialResult, world_size: int) -> float:
    """The whole job's measured tokens/s: the logged tokens/s per device (rank 0's replica's
    tokens over its tensor x pipeline x context ranks) times the devices, which run equal
    shares; the measure that compares layouts of one world size whatever their TP/PP split."""
    return (outcome.tokens_per_s or 0.0) * world_size


def _describe(outcome: TrialResult) -> str:
    if outcome.tokens_per_s is None:
        return f"{outcome.status} ({outcome.note})"
    text = f"{outcome.tokens_per_s:,.1f} tokens/s/device, peak {outcome.peak_bytes or 0:,} B"
    return text if outcome.status == "ok" else f"{outcome.status}: {text} ({outcome.note})"


def format_table(result: AutotuneResult, config: TrainingConfig) -> str:
    """The trials as a table, and the pick."""
    section = config.autotune
    limit = section.memory_limit_bytes()
    head = (
        f"autotune: {len(result.trials)} points, {section.autotune_warmup_steps} warm-up + "
        f"{section.autotune_steps} measured steps a trial, memory limit "
        f"{'none' if limit is None else f'{limit / 2**20:.1f} MiB'} per rank"
    )
    lines = [
        head,
        f"{'#':>3}  {'micro-batch':>11}  {'zero':>4}  {'recompute':<9}  {'tokens/s/dev':>12}  "
        f"{'peak MiB':>9}  {'seconds':>7}  status",
    ]
    for index, t in enumerate(result.trials, start=1):
        tps = f"{t.tokens_per_s:,.1f}" if t.tokens_per_s is not None else "-"
        peak = f"{t.peak_bytes / 2**20:.1f}" if t.peak_bytes is not None else "-"
        mark = " <- best" if t is result.best else ""
        status = t.status if t.status == "ok" else f"{t.status}: {t.note}"
        lines.append(
            f"{index:>3}  {t.trial.micro_batch_size:>11}  {t.trial.zero_stage:>4}  "
            f"{t.trial.recompute:<9}  {tps:>12}  {peak:>9}  {t.seconds:>7.1f}  {status}{mark}"
        )
    if result.best is None:
        lines.append("no trial was accepted")
    else:
        lines.append(
            f"best: {result.best.trial.flags()} ({result.best.tokens_per_s:,.1f} tokens/s/device)"
        )
    return "\n".join(lines)


def write_report(result: AutotuneResult, path: Path) -> None:
    """autotune.json: every trial with its measure, and the pick."""

    def row(t: TrialResult) -> dict:
        outcome = {k: v for k, v in dataclasses.asdict(t).items() if k != "trial"}
        return {**dataclasses.asdict(t.trial), **outcome}

    data = {
        "metric": "tokens_per_s per device, steps after the warm-up",
        "trials": [row(t) for t in result.trials],
        "best": None if result.best is None else dataclasses.asdict(result.best.trial),
    }
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
