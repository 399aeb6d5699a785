"""Per-interval training metrics: one console line, the same values in CSV and TensorBoard.

Throughput is per device: tokens this rank processed divided by wall time. FLOPs per token come
from `models.accounting.flops_per_token` (6N + 12·L·H·Q·T, no causal halving), so TFLOP/s and
MFU are comparable with Megatron/torchtitan reports. MFU divides by the device's peak
(`kernels.peak_flops`: --peak-tflops, else the device model's table entry, else a CPU measured
once at start-up).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from checkpoints.safe_fs import open_dir_beneath

CSV_COLUMNS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "tflops",
    "mfu",
    "mem_gb",
    "skipped",
    "nan",
    "loss_scale",
    "global_batch",
    "elapsed_s",
)
EVAL_COLUMNS = ("step", "val_loss", "val_ppl")


@dataclass(frozen=True)
class StepMetrics:
    """One log interval's values (averages over the interval's steps where that makes sense)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    tflops: float
    mfu: float
    mem_gb: float
    skipped: int
    nan: int
    loss_scale: float
    global_batch: int
    elapsed_s: float


def throughput(
    tokens: float, seconds: float, flops_per_token: float, peak_tflops: float
) -> tuple[float, float, float]:
    """(tokens/s, TFLOP/s, MFU) for `tokens` processed on one device in `seconds`."""
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    tflops = tokens_per_s * flops_per_token / 1e12
    return tokens_per_s, tflops, tflops / peak_tflops


def format_line(m: StepMetrics, train_iters: int) -> str:
    """Megatron-style single line."""
    width = len(str(train_iters))
    return (
        f"step {m.step:>{width}}/{train_iters} | loss {m.loss:.4f} | grad norm {m.grad_norm:.3f} | "
        f"lr {m.lr:.3e} | tokens/s/dev {m.tokens_per_s:,.0f} | TFLOP/s/dev {m.tflops:.3g} | "
        f"MFU {100 * m.mfu:.2f}% | mem {m.mem_gb:.2f} GB | skipped {m.skipped} | nan {m.nan}"
    )


class MetricsWriter:
    """Writes metrics rows to `{log_dir}/metrics.csv`, `eval.csv` and TensorBoard (rank 0 only)."""

    def __init__(
        self, log_dir: str | Path | None, *, enabled: bool = True, tensorboard: bool = True
    ) -> None:
        self.log_dir = Path(log_dir) if log_dir else None
        self.enabled = enabled and self.log_dir is not None
        self._tb: Any = None
        if not self.enabled:
            return
        assert self.log_dir is not None
        # Opened once beneath the data root (`checkpoints.safe_fs`): every write below goes
        # through this descriptor, so a log dir swapped for a symlink redirects nothing.
        self._dir = open_dir_beneath(self.log_dir, create=True)
        for name, columns in (("metrics.csv", CSV_COLUMNS), ("eval.csv", EVAL_COLUMNS)):
            info = self._dir.lstat(name)
            if info is None or info.st_size == 0:
                with self._dir.fdopen(name, "w", newline="") as fh:
                    csv.writer(fh).writerow(columns)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_dir = self._dir.subdir("tensorboard", create=True)
            self._tb = SummaryWriter(log_dir=self._tb_dir.proc_path())

    def write(self, m: StepMetrics) -> None:
        """Append one row and the matching TensorBoard scalars."""
        if not self.enabled:
            return
        row = asdict(m)
        with self._dir.fdopen("metrics.csv", "a", newline="") as fh:
            csv.writer(fh).writerow([_fmt(row[c]) for c in CSV_COLUMNS])
            fh.flush()
            os.fsync(fh.fileno())
        if self._tb is not None:
            for key in CSV_COLUMNS[1:]:
                self._tb.add_scalar(f"train/{key}", float(row[key]), m.step)
            self._tb.flush()

    def write_eval(self, step: int, val_loss: float) -> float:
        """Record validation loss and perplexity; returns the perplexity."""
        ppl = math.exp(min(val_loss, 80.0))
        if self.enabled:
            with self._dir.fdopen("eval.csv", "a", newline="") as fh:
                csv.writer(fh).writerow([step, _fmt(val_loss), _fmt(ppl)])
            if self._tb is not None:
                self._tb.add_scalar("val/loss", val_loss, step)
                self._tb.add_scalar("val/ppl", ppl, step)
                self._tb.flush()
        return ppl

    def close(self) -> None:
        """Flush and close TensorBoard."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
            self._tb_dir.close()
        if self.enabled:
            self._dir.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def read_csv(path: str | Path) -> dict[str, list[float]]:
    """Columns of a metrics CSV as float lists (for plots and tests)."""
    with Path(path).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return {}
    return {key: [float(r[key]) for r in rows] for key in rows[0]}
