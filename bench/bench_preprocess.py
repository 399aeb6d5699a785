"""Preprocess throughput and memory: `meshline preprocess` against `datasets.map(batched=True)`.

Three measurements on one generated jsonl corpus and one locally trained HF fast (byte-level BPE)
tokenizer, both built in a temporary directory:

1. tokens/s of `run_preprocess` (read jsonl -> tokenise -> Megatron .bin/.idx + manifest) against
   `datasets.load_dataset("json") + .map(batched=True)` with the same tokenizer and no special
   tokens (cache off, in memory): the ratio ours / baseline;
2. 1 -> 2 worker scaling of `run_preprocess` (ratio of tokens/s);
3. peak RSS of `meshline preprocess` (in-process tokenising, one subprocess per size) as the
   input grows 1x, 2x, 4x: flat means streaming works.

Each full run prints its configuration. `--quick` uses a small corpus (about half a minute on two
cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from models.tokenizer import train_bpe_tokenizer
from services.preprocess.job import PreprocessConfig, run_preprocess

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "that",
    "with",
    "as",
    "on",
    "by",
    "this",
    "be",
    "are",
    "from",
    "it",
    "at",
    "or",
    "an",
    "which",
    "model",
    "data",
    "token",
    "training",
    "layer",
    "parallel",
    "tensor",
    "pipeline",
    "gradient",
    "optimizer",
    "learning",
    "rate",
    "batch",
    "sequence",
    "attention",
    "head",
    "embedding",
    "vocabulary",
    "shard",
    "document",
    "corpus",
    "checkpoint",
    "device",
    "memory",
    "kernel",
    "language",
    "large",
    "small",
    "fast",
    "slow",
    "compute",
    "network",
    "service",
    "process",
    "worker",
    "output",
    "input",
    "result",
]


def write_corpus(path: Path, documents: int, words_per_doc: int, seed: int = 0) -> int:
    """A jsonl corpus of pseudo-random English-like documents; returns its size in bytes."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(documents):
            n = rng.randint(words_per_doc // 2, words_per_doc * 3 // 2)
            text = " ".join(rng.choice(WORDS) for _ in range(n)) + f". Document {index}."
            handle.write(json.dumps({"text": text}) + "\n")
    return path.stat().st_size


def baseline_tokens_per_s(corpus: Path, tokenizer_dir: Path) -> tuple[float, int]:
    """datasets.load_dataset + map(batched=True) with the same fast tokenizer; (tokens/s, tokens)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_caching()
    datasets.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    start = time.perf_counter()
    loaded = datasets.load_dataset(
        "json", data_files=str(corpus), split="train", keep_in_memory=True
    )
    mapped = loaded.map(
        lambda batch: tokenizer(batch["text"], add_special_tokens=False),
        batched=True,
        remove_columns=["text"],
        keep_in_memory=True,
    )
    tokens = sum(len(ids) for ids in mapped["input_ids"])
    return tokens / (time.perf_counter() - start), tokens


def ours_tokens_per_s(
    corpus: Path, tokenizer_dir: Path, out: Path, workers: int
) -> tuple[float, int]:
    """run_preprocess end to end (reading, tokenising, writing, manifest); (tokens/s, tokens)."""
    start = time.perf_counter()
    result = run_preprocess(
        PreprocessConfig(
            input=(str(corpus),),
            output_prefix=str(out),
            tokenizer_type="PretrainedFromHF",
            tokenizer_name_or_path=str(tokenizer_dir),
            workers=workers,
            chunk_size=1000,
            overwrite=True,
        )
    )
    return result.tokens / (time.perf_counter() - start), result.tokens


def peak_rss_mb(corpus: Path, tokenizer_dir: Path, out: Path) -> float:
    """Peak RSS (MiB) of one `meshline preprocess` run in a fresh interpreter."""
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over exec from the forking parent.
    code = (
        "import sys\n"
        "from services.preprocess.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "hwm = next(x for x in open('/proc/self/status') if x.startswith('VmHWM'))\n"
        "print('PEAK_RSS_KB', hwm.split()[1])\n"
        "sys.exit(code)\n"
    )
    args = [
        "--input", str(corpus), "--output-prefix", str(out), "--tokenizer-type", "PretrainedFromHF",
        "--tokenizer-name-or-path", str(tokenizer_dir), "--overwrite", "--log-interval", "100000000",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("PEAK_RSS_KB"))
    return int(line.split()[1]) / 1024


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print ratios."""
    parser = argparse.ArgumentParser(prog="bench_preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small corpus (about half a minute)")
    parser.add_argument("--documents", type=int, help="documents in the throughput corpus")
    parser.add_argument(
        "--repeat", type=int, help="best of N timings per configuration (default 1 quick, 3 full)"
    )
    args = parser.parse_args(argv)
    documents = args.documents or (10_000 if args.quick else 100_000)
    rss_base = 10_000 if args.quick else 50_000
    words = 120

    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        size = write_corpus(corpus, documents, words)
        sample = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:2000]]
        tokenizer_dir = train_bpe_tokenizer(sample, root / "tokenizer", vocab_size=4096)
        print(
            f"config: {documents} documents (~{words} words each), {size / 1e6:.1f} MB jsonl; "
            f"HF fast byte-level BPE vocab 4096; os.cpu_count()={os.cpu_count()}; "
            f"best of {args.repeat or (1 if args.quick else 3)}"
        )
        repeat = args.repeat or (1 if args.quick else 3)
        base = one = two = 0.0
        for _ in range(repeat):  # best of N: the machine may be shared
            rate, base_tokens = baseline_tokens_per_s(corpus, tokenizer_dir)
            base = max(base, rate)
            rate, tokens = ours_tokens_per_s(corpus, tokenizer_dir, root / "w1" / "c", workers=1)
            one = max(one, rate)
            rate, _ = ours_tokens_per_s(corpus, tokenizer_dir, root / "w2" / "c", workers=2)
            two = max(two, rate)
        if tokens != base_tokens:
            print(f"error: token counts differ (ours {tokens}, datasets.map {base_tokens})")
            return 1
        print(f"datasets.map(batched=True): {base:,.0f} tokens/s ({base_tokens:,} tokens)")
        print(
            f"meshline preprocess workers=1: {one:,.0f} tokens/s  ratio ours/baseline = {one / base:.2f}"
        )
        print(
            f"meshline preprocess workers=2: {two:,.0f} tokens/s  ratio ours/baseline = {two / base:.2f}"
        )
        print(f"worker scaling 1 -> 2: {two / one:.2f}x")
        rows = []
        for factor in (1, 2, 4):
            grown = root / f"rss_{factor}.jsonl"
            mb = write_corpus(grown, rss_base * factor, words, seed=factor) / 1e6
            rows.append(
                (factor, mb, peak_rss_mb(grown, tokenizer_dir, root / f"rss{factor}" / "c"))
            )
            grown.unlink()
        for factor, mb, rss in rows:
            print(f"streaming input {factor}x ({mb:.0f} MB): peak RSS {rss:.0f} MiB")
        print(f"peak RSS ratio 4x / 1x input: {rows[-1][2] / rows[0][2]:.2f} (1.00 = flat)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
