"""Worker entry point: `torchrun --nproc-per-node N -m services.trainer.train <flags>`.

Also runs as a single process (`python -m services.trainer.train <flags>`). Joins the process
group from torchrun's environment, trains, prints a summary and writes `summary.json` into
--log-dir on rank 0. SIGTERM (sent by torchrun or Kubernetes) ends the run at the next step
boundary on every rank at once and still saves when --save is given (unless
$MESHLINE_SAVE_ON_STOP=0, which the launcher sets for `save_on_stop=False`); SIGUSR2 ends it the
same way without the save (StopTraining with save_checkpoint=false).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

from checkpoints.safe_fs import Escape, open_dir_beneath
from kernels import device
from kernels.cpu.allocator import keep_freed_memory
from kernels.cpu.threads import apply_torch_threads
from services.common.errors import PermissionDenied
from services.common.paths import check_at_use
from services.trainer.arguments import parse_args
from services.trainer.request_paths import PERMISSION_DENIED_TAG, path_values
from services.trainer.rollouts import colocated_rollouts
from training.ckpt.signals import LastGasp
from training.launch_checks import check_paths, load_action
from training.loop import SAVE_ON_STOP_ENV, NonFiniteLossError, RunSummary, Trainer
from training.objectives.layout import RL_STAGES

log = logging.getLogger(__name__)


def format_summary(summary: RunSummary, log_dir: str | None) -> str:
    """Human-readable end-of-run block."""
    lines = [
        "training finished",
        f"  steps            {summary.steps}",
        f"  loss             {summary.first_loss:.4f} -> {summary.final_loss:.4f}",
        f"  tokens/s/device  {summary.tokens_per_s:,.0f}",
        f"  skipped / nan    {summary.skipped} / {summary.nan}",
    ]
    if summary.val_loss is not None:
        lines.append(
            f"  validation loss  {summary.val_loss:.4f} (ppl {math.exp(min(summary.val_loss, 80)):.2f})"
        )
    if summary.stopped_by:
        lines.append(f"  stopped early    by {summary.stopped_by}")
    if summary.checkpoint:
        lines.append(f"  checkpoint       {summary.checkpoint}")
    if log_dir:
        lines.append(
            f"  metrics          {Path(log_dir) / 'metrics.csv'} (meshline plot {log_dir})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train, print the summary; 2 on a configuration error, 3 on a NaN stop."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = parse_args(argv, read_files=True)
        # Under a service ($MESHLINE_DATA_ROOTS) the paths were resolved when the request came
        # in; one that has become a symlink leaving the roots since then is refused here.
        for flag, path in path_values(config):
            check_at_use(path, flag)
        check_paths(config)
        load = load_action(config)
    except ValueError as exc:
        print(f"meshline train: {exc}", file=sys.stderr)
        return 2
    except PermissionDenied as exc:
        print(f"meshline train: {PERMISSION_DENIED_TAG} {exc.message}", file=sys.stderr)
        return 2
    info = device.init_distributed()
    if device.current().type == "cpu":
        apply_torch_threads()  # the cgroup quota / affinity mask, not the host's core count
    if device.current().type == "cpu" and keep_freed_memory():
        log.info("CPU worker: freed host memory is kept for the next step (glibc mallopt)")
    if load == "fresh" and info.is_main:
        print(
            f"meshline train: no checkpoint in --load {config.run.load} yet: starting from step 0",
            file=sys.stderr,
            flush=True,
        )
    last_gasp = LastGasp().install()
    try:
        rollouts = colocated_rollouts if config.run.stage in RL_STAGES else None
        trainer = Trainer(config, path_guard=check_at_use, rollouts=rollouts)
        if load == "resume":
            trainer.load()
        # The launch-time policy ($MESHLINE_SAVE_ON_STOP), then the signal that stopped the run.
        save_default = os.environ.get(SAVE_ON_STOP_ENV, "1") != "0"
        summary = trainer.fit(
            stop=last_gasp.agreed, save_on_stop=lambda: save_default and last_gasp.save_agreed
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshline train: {exc}", file=sys.stderr)
        return 2
    except PermissionDenied as exc:
        print(f"meshline train: {PERMISSION_DENIED_TAG} {exc.message}", file=sys.stderr)
        return 2
    except NonFiniteLossError as exc:
        print(f"meshline train: {exc}", file=sys.stderr)
        return 3
    finally:
        last_gasp.uninstall()
        device.destroy_distributed()
    if info.is_main:
        print(format_summary(summary, config.run.log_dir), flush=True)
        if config.run.log_dir:
            try:
                write_summary(summary, config.run.log_dir)
            except Escape as exc:
                print(
                    f"meshline train: {PERMISSION_DENIED_TAG} --log-dir: {exc.filename!r}: "
                    f"{exc.strerror}; it changed during the run, summary.json not written",
                    file=sys.stderr,
                )
                return 2
    return 0


def write_summary(summary: RunSummary, log_dir: str | Path) -> None:
    """`summary.json` in `log_dir`, written atomically beneath the data root (`safe_fs`): a log
    dir swapped for a symlink since the run began makes this raise `Escape`, writing nothing."""
    with open_dir_beneath(log_dir, create=True) as directory:
        directory.write_text("summary.json", json.dumps(asdict(summary), indent=2))


if __name__ == "__main__":
    sys.exit(main())
