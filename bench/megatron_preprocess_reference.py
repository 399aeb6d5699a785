"""Reference for `bench_preprocess_cli`: Megatron-LM's `tools/preprocess_data.py` for one jsonl file.

megatron-core (installed) ships the `.bin/.idx` builder but not Megatron-LM's `tools/` script,
so this is that script's path for `--input X.jsonl --json-keys text --workers 1
--tokenizer-type HuggingFaceTokenizer` without `--split-sentences` or `--append-eod`, step for
step: a `multiprocessing.Pool(workers)` runs `Encoder.encode` on each line (`json.loads`, then
the HF tokenizer's `tokenizer(text).input_ids`) with `imap(..., 32)`, and the parent adds each
document to megatron-core's `IndexedDatasetBuilder` (dtype `DType.optimal_dtype(vocab)`),
then finalises `{prefix}_text_document.bin/.idx`.

    python bench/megatron_preprocess_reference.py INPUT.jsonl OUTPUT_PREFIX TOKENIZER_DIR [WORKERS]

Prints `ELAPSED_S <seconds>` (after imports, like the manifest's elapsed_seconds of ours).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from typing import Any

_TOKENIZER: Any = None


def _init(tokenizer_dir: str) -> None:
    global _TOKENIZER
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(tokenizer_dir)


def _encode(json_line: str) -> tuple[list[int], list[int], int]:
    text = json.loads(json_line)["text"]
    ids = _TOKENIZER(text).input_ids
    lens = [len(ids)] if ids else []
    return ids, lens, len(json_line)


def main(argv: list[str]) -> int:
    """Tokenise `argv[0]` into `{argv[1]}_text_document.bin/.idx` the way Megatron-LM does."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from transformers import AutoTokenizer

    source, prefix, tokenizer_dir = argv[0], argv[1], argv[2]
    workers = int(argv[3]) if len(argv) > 3 else 1
    start = time.perf_counter()
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    dtype = DType.optimal_dtype(vocab)
    builder = IndexedDatasetBuilder(f"{prefix}_text_document.bin", dtype=dtype)
    with (
        open(source, encoding="utf-8") as lines,
        multiprocessing.Pool(workers, initializer=_init, initargs=(tokenizer_dir,)) as pool,
    ):
        for ids, lens, _ in pool.imap(_encode, lines, 32):
            builder.add_document(ids, lens)  # Megatron passes the list as is
    builder.finalize(f"{prefix}_text_document.idx")
    print(f"ELAPSED_S {time.perf_counter() - start:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
