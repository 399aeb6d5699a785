"""The user's path: `meshline preprocess` (default flags) against Megatron-LM's preprocess_data.py.

    python -m bench.bench_preprocess_cli [--quick] [--documents N] [--rounds R]

On one generated jsonl corpus and one locally trained HF fast byte-level BPE tokenizer (vocab
4096), each round launches, one after the other (interleaved, the order alternating):

- ours: the `meshline` console script, `meshline preprocess --input C --output-prefix P
  --tokenizer-name-or-path T` and nothing else (the defaults: PretrainedFromHF, json key text,
  1 worker, mmap output);
- the reference: `bench/megatron_preprocess_reference.py` (Megatron-LM's tools/preprocess_data.py
  path with `--workers 1`: a Pool(1) tokenises line by line, megatron-core's
  `IndexedDatasetBuilder` writes).

Both write `{prefix}_text_document.bin/.idx`; the benchmark checks the files are byte-identical,
then prints per round the wall time of each process (start-up and imports included: what the
user waits for) and the time after imports (ours: the manifest's elapsed_seconds; the
reference: its own clock), min and median over the rounds, and the ratios reference / ours
(> 1: ours faster). The writer alone is timed by `bench_datasets`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_preprocess import write_corpus
from models.tokenizer import train_bpe_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the user's environment, nothing tuned
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done.stdout


def _ours(corpus: Path, prefix: Path, tokenizer: Path) -> tuple[float, float]:
    meshline = Path(sys.executable).with_name("meshline")
    cmd = [str(meshline), "preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
           "--tokenizer-name-or-path", str(tokenizer), "--overwrite"]  # fmt: skip
    wall, _ = _run(cmd)
    manifest = json.loads(Path(f"{prefix}.manifest.json").read_text())
    return wall, float(manifest["counts"]["elapsed_seconds"])


def _reference(corpus: Path, prefix: Path, tokenizer: Path) -> tuple[float, float]:
    script = REPO / "bench" / "megatron_preprocess_reference.py"
    wall, out = _run([sys.executable, str(script), str(corpus), str(prefix), str(tokenizer)])
    line = next(x for x in out.splitlines() if x.startswith("ELAPSED_S"))
    return wall, float(line.split()[1])


def _summary(name: str, ours: list[float], theirs: list[float]) -> None:
    o_min, t_min = min(ours), min(theirs)
    o_med, t_med = statistics.median(ours), statistics.median(theirs)
    print(
        f"{name:<22} ours min {o_min:6.2f} s median {o_med:6.2f} s | reference min {t_min:6.2f} s "
        f"median {t_med:6.2f} s | reference/ours: min {t_min / o_min:.2f}x, median "
        f"{t_med / o_med:.2f}x",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds and print the ratios."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_preprocess_cli", description=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="3,000 documents, 2 rounds")
    parser.add_argument("--documents", type=int, default=None)
    parser.add_argument("--words", type=int, default=120, help="mean words per document")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    documents = args.documents or (3_000 if args.quick else 20_000)
    rounds = args.rounds or (2 if args.quick else 3)
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        print("megatron-core is not installed; install the dev extras to compare")
        return 1

    with tempfile.TemporaryDirectory(prefix="bench_preprocess_cli_") as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        size = write_corpus(corpus, documents, args.words)
        sample = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:2000]]
        tokenizer = train_bpe_tokenizer(sample, root / "tokenizer", vocab_size=4096)
        print(
            f"config: {documents} documents (~{args.words} words), {size / 1e6:.1f} MB jsonl; HF "
            f"fast byte-level BPE vocab 4096; {rounds} interleaved rounds; os.cpu_count()="
            f"{os.cpu_count()}; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        walls: dict[str, list[float]] = {"ours": [], "ref": []}
        works: dict[str, list[float]] = {"ours": [], "ref": []}
        for r in range(rounds):
            order = ("ours", "ref") if r % 2 == 0 else ("ref", "ours")
            for who in order:
                if who == "ours":
                    wall, work = _ours(corpus, root / "ours" / "c", tokenizer)
                else:
                    wall, work = _reference(corpus, root / "ref", tokenizer)
                walls[who].append(wall)
                works[who].append(work)
            print(
                f"round {r + 1}: wall ours {walls['ours'][-1]:.2f} s, reference "
                f"{walls['ref'][-1]:.2f} s; after imports ours {works['ours'][-1]:.2f} s, "
                f"reference {works['ref'][-1]:.2f} s",
                flush=True,
            )
        for suffix in (".bin", ".idx"):
            ours_file = root / "ours" / f"c_text_document{suffix}"
            ref_file = root / f"ref_text_document{suffix}"
            if ours_file.read_bytes() != ref_file.read_bytes():
                print(f"error: {ours_file.name} differs from the reference's {ref_file.name}")
                return 1
        print("outputs: byte-identical .bin and .idx", flush=True)
        _summary("wall (process)", walls["ours"], walls["ref"])
        _summary("after imports", works["ours"], works["ref"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
