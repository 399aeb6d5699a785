"""`meshline train --autotune`: each trial of `training.autotune` as a launch of this job's own
workers, then the run with the fastest settings.

The trials and the run go through `launcher.launch` with the same process count, so a trial
measures what the run will do; each trial writes its config (train_config.yaml), its output
(trial.log) and its metrics.csv in its own folder of --autotune-dir, and the run is launched
from the chosen config written there (chosen/train_config.yaml), which is what its workers read.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

from checkpoints.safe_fs import open_dir_beneath
from services.trainer.launcher import config_argv, launch
from services.trainer.train_config import TrainConfig
from training import autotune
from training.config import TrainingConfig


def trial_runner(nproc_per_node: int) -> autotune.RunTrial:
    """Each trial as a launch of `nproc_per_node` workers of this job, stopped at its timeout."""

    def run_trial(config: TrainingConfig, directory: Path, timeout: float) -> autotune.TrialRun:
        assert isinstance(config, TrainConfig)
        stop, expired = threading.Event(), threading.Event()

        def expire() -> None:
            expired.set()
            stop.set()  # the workers stop at their next step (launch's stop_event)

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            with (directory / "trial.log").open("w", encoding="utf-8") as log:
                argv = config_argv(config, directory)
                code = launch(argv, nproc_per_node, output=log, stop_event=stop, save_on_stop=False)
        finally:
            timer.cancel()
        return autotune.TrialRun(code, timed_out=expired.is_set())

    return run_trial


def plan_text(config: TrainConfig, world_size: int) -> str:
    """The points `--autotune` would try (for --dry-run)."""
    trials = autotune.plan(config, world_size)
    lines = [f"--autotune would try {len(trials)} points (each a short launch of this job):"]
    lines += [f"  {t.flags()}" for t in trials]
    return "\n".join(lines)


def run(config: TrainConfig, nproc_per_node: int) -> int:
    """Tune, print the table, train with the pick; 2 when no trial is accepted."""
    section = config.autotune
    base = section.autotune_dir or (
        str(Path(config.run.log_dir) / "autotune") if config.run.log_dir else None
    )
    with tempfile.TemporaryDirectory(prefix="meshline-autotune-") as scratch:
        directory = Path(base) if base else Path(scratch)
        with open_dir_beneath(directory, roots=(), create=True):
            pass  # created beneath its resolved parent, never through a symlink
        result = autotune.tune(config, nproc_per_node, trial_runner(nproc_per_node), directory)
        print(autotune.format_table(result, config), flush=True)
        autotune.write_report(result, directory / "autotune.json")
        if result.best is None:
            print(
                "meshline train: --autotune: no trial was accepted (table above); relax "
                "--autotune-memory-limit or the search space",
                file=sys.stderr,
            )
            return 2
        chosen = autotune.apply(config, result.best.trial)
        chosen.validate(nproc_per_node)
        argv = config_argv(chosen, directory / "chosen")
        print(f"autotune: training with {result.best.trial.flags()} ({argv[1]})", flush=True)
        return launch(argv, nproc_per_node)
