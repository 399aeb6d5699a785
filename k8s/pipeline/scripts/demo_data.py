"""Pipeline demo data: the standard library's sources as a JSONL corpus, and a tokenizer on them.

Used by the pipeline's preprocess stage when the configured corpus does not exist, so that the
pipeline runs end to end on a fresh kind/minikube cluster without any download. With
`--parts N` the corpus is a directory of N JSONL files (`part-00000.jsonl`, ... in reading
order, about equal in size), which the preprocess Indexed Job splits over its pods.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from models.tokenizer import train_sentencepiece
from services.demos.train import VOCAB_SIZE, collect_stdlib


def split_lines(corpus: Path, out_dir: Path, parts: int) -> None:
    """Write corpus's lines as `parts` contiguous files of about equal bytes under out_dir."""
    lines = corpus.read_bytes().splitlines(keepends=True)
    if len(lines) < parts:
        raise SystemExit(f"demo corpus has {len(lines)} records, fewer than --parts {parts}")
    out_dir.mkdir()
    total, done, part = sum(len(line) for line in lines), 0, 0
    handle = (out_dir / "part-00000.jsonl").open("wb")
    for i, line in enumerate(lines):
        left = len(lines) - i
        # Next file once this one has its share, keeping a record for every file still to come.
        if part < parts - 1 and (done >= total * (part + 1) / parts or left == parts - 1 - part):
            handle.close()
            part += 1
            handle = (out_dir / f"part-{part:05d}.jsonl").open("wb")
        handle.write(line)
        done += len(line)
    handle.close()


def main(argv: list[str] | None = None) -> int:
    """Writes --corpus and --tokenizer (each only complete once renamed into place)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="corpus JSONL (or directory) to write")
    parser.add_argument("--tokenizer", required=True, help="SentencePiece .model to write")
    parser.add_argument("--corpus-mb", type=float, default=8.0, help="stdlib bytes to use (MiB)")
    parser.add_argument(
        "--parts",
        type=int,
        default=0,
        help="write a directory of this many JSONL files (0: one file)",
    )
    args = parser.parse_args(argv)
    corpus, tokenizer = Path(args.corpus), Path(args.tokenizer)
    corpus.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=corpus.parent) as tmp:
        built, sample, files = collect_stdlib(Path(tmp), int(args.corpus_mb * 2**20))
        if args.parts > 0:
            split_lines(built, Path(tmp) / "parts", args.parts)
            built = Path(tmp) / "parts"
        model = train_sentencepiece([sample], Path(tmp) / "tokenizer", VOCAB_SIZE)
        shutil.move(str(model), tokenizer)
        shutil.move(str(built), corpus)
    print(f"pipeline: {files} stdlib files -> {corpus}; tokenizer -> {tokenizer}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
