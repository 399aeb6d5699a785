"""`make train`: stdlib corpus -> sentencepiece -> token shards -> 2-process CPU training -> summary.

    python -m services.demos.train --data-dir data --run-dir runs/make-train

1. Collects this Python's standard-library `.py` files (sorted, capped at --corpus-mb) into
   `{data-dir}/stdlib/corpus.jsonl` and a text sample for the tokenizer.
2. Trains a sentencepiece BPE model on them (`models.tokenizer.train_sentencepiece`).
3. Tokenises the corpus into Megatron `.bin/.idx` shards (`services.preprocess.job.run_preprocess`).
   Steps 1-3 are cached: a stamp file records their settings and they are skipped when it matches.
4. Launches 2 data-parallel workers through torchrun (`services.trainer.launcher`) to train a
   small Llama-style model, saving a checkpoint, metrics and plots under --run-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

from services.trainer.arguments import parse_args
from services.trainer.launcher import launch
from training.metrics import read_csv

VOCAB_SIZE = 2048
STAMP = "stamp.json"
# Small Llama: 4 layers, hidden 128, about 1.3M parameters with the 2048-token vocabulary.
MODEL_FLAGS = [
    "--model", "tiny-llama", "--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "352",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--max-position-embeddings", "256",
    "--seq-length", "128",
]  # fmt: skip


def collect_stdlib(out_dir: Path, max_bytes: int) -> tuple[Path, Path, int]:
    """Write corpus.jsonl (one record per file) and tokenizer_sample.txt; returns paths and files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
    )
    if not files:
        raise ValueError(f"no .py files under the standard library at {stdlib}")
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus, sample = out_dir / "corpus.jsonl", out_dir / "tokenizer_sample.txt"
    total = count = 0
    with corpus.open("w", encoding="utf-8") as cfh, sample.open("w", encoding="utf-8") as sfh:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            cfh.write(json.dumps({"text": text, "path": str(path.relative_to(stdlib))}) + "\n")
            sfh.write(text if text.endswith("\n") else text + "\n")
            total += len(text.encode("utf-8"))
            count += 1
            if total >= max_bytes:
                break
    return corpus, sample, count


def prepare_data(data_dir: Path, corpus_mb: float) -> tuple[Path, str]:
    """Tokenizer model and shard prefix under `data_dir` (built once; reused while the stamp matches)."""
    # imported here: only a first run (no stamped shards yet) builds the tokenizer and shards
    from models.tokenizer import train_sentencepiece
    from services.preprocess.job import run_preprocess
    from services.preprocess.job_config import PreprocessConfig

    root = data_dir / "stdlib"
    settings = {"corpus_mb": corpus_mb, "vocab_size": VOCAB_SIZE, "python": sys.version.split()[0]}
    tokenizer = root / "tokenizer" / "stdlib_sp.model"
    prefix = root / "shards" / "stdlib"
    shard = f"{prefix}_text_document"
    stamp = root / STAMP
    cached = [tokenizer, Path(shard + ".bin"), Path(shard + ".idx")]
    if (
        stamp.is_file()
        and json.loads(stamp.read_text()) == settings
        and all(p.is_file() for p in cached)
    ):
        print(f"[data] reusing {tokenizer} and {shard}.bin/.idx", flush=True)
        return tokenizer, shard
    stamp.unlink(missing_ok=True)
    start = time.perf_counter()
    corpus, sample, files = collect_stdlib(root, int(corpus_mb * 2**20))
    print(f"[data] {files} stdlib files -> {corpus}", flush=True)
    tokenizer = train_sentencepiece([sample], tokenizer.with_suffix(""), VOCAB_SIZE)
    print(f"[data] sentencepiece ({VOCAB_SIZE} pieces) -> {tokenizer}", flush=True)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    result = run_preprocess(
        PreprocessConfig(
            input=(str(corpus),),
            output_prefix=str(prefix),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(tokenizer),
            append_eod=True,
            overwrite=True,
        )
    )
    print(
        f"[data] {result.documents} documents, {result.tokens:,} tokens -> {shard}.bin/.idx "
        f"({time.perf_counter() - start:.0f}s)",
        flush=True,
    )
    stamp.write_text(json.dumps(settings))
    return tokenizer, shard


def train_flags(tokenizer: Path, shard: str, run_dir: Path, train_iters: int) -> list[str]:
    """The training flags of the demo run."""
    return [
        *MODEL_FLAGS,
        "--data-path", shard, "--split", "98,2,0",
        "--tokenizer-type", "SentencePiece", "--tokenizer-model", str(tokenizer),
        "--micro-batch-size", "8", "--global-batch-size", "16",
        "--optimizer", "adamw", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(min(20, train_iters // 10)), "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--train-iters", str(train_iters), "--log-interval", "10",
        "--eval-interval", str(max(train_iters // 3, 1)), "--eval-iters", "4",
        "--save", str(run_dir / "checkpoints"), "--log-dir", str(run_dir / "logs"), "--seed", "1234",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the whole demo; 0 on success."""
    parser = argparse.ArgumentParser(
        prog="python -m services.demos.train", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--data-dir", default="data", help="cache for the corpus, tokenizer and shards"
    )
    parser.add_argument(
        "--run-dir", default="runs/make-train", help="checkpoints, metrics and plots"
    )
    parser.add_argument("--train-iters", type=int, default=300, help="optimizer steps")
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel worker processes")
    parser.add_argument("--corpus-mb", type=float, default=8.0, help="stdlib bytes to use (MiB)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    run_dir = Path(args.run_dir)
    try:
        tokenizer, shard = prepare_data(Path(args.data_dir), args.corpus_mb)
        flags = train_flags(tokenizer, shard, run_dir, args.train_iters)
        parse_args(flags).validate(args.nproc)
    except ValueError as exc:
        print(f"make train: {exc}", file=sys.stderr)
        return 2
    (run_dir / "logs" / "metrics.csv").unlink(missing_ok=True)
    (run_dir / "logs" / "eval.csv").unlink(missing_ok=True)
    print(
        f"[train] {args.nproc} processes (DP{args.nproc}) via torchrun, {args.train_iters} steps",
        flush=True,
    )
    code = launch(flags, args.nproc, env={"OMP_NUM_THREADS": "1"})
    if code != 0:
        print(f"make train: training exited with code {code}", file=sys.stderr)
        return code
    # imported here: only a finished run is plotted
    from services.trainer.plot import plot_run

    plots = plot_run(run_dir / "logs")
    print(summary_text(run_dir, plots, time.perf_counter() - started), flush=True)
    return 0


def summary_text(run_dir: Path, plots: list[Path], seconds: float) -> str:
    """The closing summary of `make train`."""
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    rows = read_csv(run_dir / "logs" / "metrics.csv")
    tps = rows["tokens_per_s"][1:] or rows["tokens_per_s"]
    return "\n".join(
        [
            "",
            "make train: done",
            f"  loss            {summary['first_loss']:.3f} (step 1) -> {summary['final_loss']:.3f} "
            f"(step {summary['steps']})",
            f"  validation      {summary['val_loss']:.3f}"
            if summary["val_loss"] is not None
            else "",
            f"  throughput      {sum(tps) / len(tps):,.0f} tokens/s per process (steady state)",
            f"  checkpoint      {summary['checkpoint']}",
            f"  metrics         {run_dir / 'logs' / 'metrics.csv'} (TensorBoard: {run_dir / 'logs' / 'tensorboard'})",
            f"  plots           {', '.join(str(p) for p in plots)}",
            f"  wall time       {seconds:.0f}s",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
