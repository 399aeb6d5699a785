"""`meshline plot LOG_DIR`: PNG curves (loss, learning rate, throughput) from a run's metrics.csv."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from training.metrics import read_csv

PLOTS = {
    "loss.png": ("loss", "training loss", "loss"),
    "lr.png": ("lr", "learning rate", "lr"),
    "throughput.png": ("tokens_per_s", "throughput per device", "tokens / s"),
}


def plot_run(log_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs for `log_dir` (into `out_dir`, default `log_dir/plots`); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log_dir = Path(log_dir)
    csv_path = log_dir / "metrics.csv"
    if not csv_path.is_file():
        raise ValueError(f"{log_dir}: no metrics.csv here; pass the --log-dir of a training run")
    data = read_csv(csv_path)
    if not data:
        raise ValueError(f"{csv_path} has no rows yet; plot again once the run has logged a step")
    evals = read_csv(log_dir / "eval.csv") if (log_dir / "eval.csv").is_file() else {}
    out = Path(out_dir) if out_dir else log_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (column, title, ylabel) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        ax.plot(
            data["step"], data[column], label="train" if column == "loss" else column, linewidth=1.6
        )
        if column == "loss" and evals:
            ax.plot(evals["step"], evals["val_loss"], "o-", label="validation", linewidth=1.2)
            ax.legend()
        if column == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.set_title(f"{title} — {log_dir.name}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        target = out / filename
        tmp = target.with_name(target.stem + ".tmp.png")
        fig.savefig(tmp)
        plt.close(fig)
        tmp.replace(target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    """CLI entry: `meshline plot LOG_DIR [--out DIR]`."""
    parser = argparse.ArgumentParser(prog="meshline plot", description=__doc__, allow_abbrev=False)
    parser.add_argument("log_dir", help="a training run's --log-dir (holds metrics.csv)")
    parser.add_argument("--out", help="where to write the PNGs (default LOG_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.log_dir, args.out)
    except ValueError as exc:
        print(f"meshline plot: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
