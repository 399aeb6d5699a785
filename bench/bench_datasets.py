"""Token shards and sample indices: Meshline's `services.preprocess` readers vs megatron-core.

    python -m bench.bench_datasets [--quick] [--docs N] [--seq-length S]

On one synthetic corpus (documents of log-normal length, uint16 ids) it times, for ours and
megatron-core 0.16 in the same run: writing the `.bin/.idx` shard; building (and caching) the
GPT sample index for `--samples` samples; reading samples through the dataset; building blend
indices for 2, 3 and 5 datasets. The writer and blend timings interleave ours and
megatron-core's in each round. It also reports the packing fill of first-fit decreasing against
in-order next-fit packing. Ratios are ours / megatron time (< 1: ours faster). Each timing is
the best of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokendata.datasets import DataConfig, build_datasets
from tokendata.datasets.blended import build_blending_indices
from tokendata.datasets.packing import first_fit, packing_efficiency
from tokendata.indexed import IndexedDatasetWriter


def _best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _best_interleaved(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Best time of each function over `repeats` rounds that run them one after the other."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _corpus(num_docs: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.5, 1.0, size=num_docs).astype(np.int64), 1, 8192)
    flat = rng.integers(3, 32000, size=int(lengths.sum()), dtype=np.int64)
    return np.split(flat, np.cumsum(lengths)[:-1])


class _Tokenizer:
    vocab_size = 32000
    eod = 2
    pad = 1
    unique_identifiers = {"class": "bench"}  # noqa: RUF012 - read-only attribute Megatron reads


def _report(name: str, ours: float, theirs: float, config: str) -> None:
    print(
        f"{name:<22} ours {ours * 1e3:10.1f} ms   megatron {theirs * 1e3:10.1f} ms   "
        f"ratio {ours / theirs:6.2f}   ({config})",
        flush=True,
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_datasets", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small corpus (CI-sized)")
    parser.add_argument("--docs", type=int, default=None, help="documents in the corpus")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=None, help="samples to index")
    parser.add_argument("--reads", type=int, default=2000, help="samples read through each dataset")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--blend-samples",
        type=int,
        default=None,
        help="samples in each blend order (default: the indexed samples, at most 200,000)",
    )
    return parser.parse_args(argv)


def _compare_writers(root: Path, corpus: list[np.ndarray], repeats: int) -> None:
    """Time writing the shard (batched, per document, megatron-core) and check the bytes match."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # optional: dev extra

    def write_ours() -> None:  # what `meshline preprocess` runs (MmapSink batches)
        with IndexedDatasetWriter(root / "ours", np.uint16) as writer:
            writer.add_documents(corpus)

    def write_ours_each() -> None:  # one call per document (the older API)
        with IndexedDatasetWriter(root / "each", np.uint16) as writer:
            for doc in corpus:
                writer.add_document(doc)

    def write_megatron() -> None:
        builder = IndexedDatasetBuilder(str(root / "theirs.bin"), dtype=np.uint16)
        for doc in corpus:
            builder.add_document(doc, [doc.size])
        builder.finalize(str(root / "theirs.idx"))

    docs = len(corpus)
    batched, each, theirs = _best_interleaved(
        [write_ours, write_ours_each, write_megatron], repeats
    )
    _report("write .bin/.idx", batched, theirs, f"{docs} int64 docs, add_documents")
    _report("write, per document", each, theirs, f"{docs} int64 docs, add_document each")
    for name in ("ours", "each"):
        for suffix in (".idx", ".bin"):
            mine = (root / f"{name}{suffix}").read_bytes()
            assert mine == (root / f"theirs{suffix}").read_bytes(), (name, suffix)


def _compare_indices(root: Path, seq: int, samples: int, repeats: int) -> tuple[Any, Any]:
    """Time building (and caching) the GPT sample index; returns one dataset of each side."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (  # optional: dev extra
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPT
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    prefix = str(root / "ours")
    run = {"n": 0}

    def index_ours() -> Any:
        run["n"] += 1
        config = DataConfig(data_path=[prefix], split="1,0,0", cache_dir=str(root / f"o{run['n']}"))
        return build_datasets(config, {"eod_id": 2, "pad_id": 1}, seq, 1234, (samples, 0, 0))[0]

    def index_megatron() -> Any:
        run["n"] += 1
        config = GPTDatasetConfig(
            random_seed=1234,
            sequence_length=seq,
            blend=([prefix], None),
            split="1,0,0",
            tokenizer=_Tokenizer(),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            path_to_cache=str(root / f"m{run['n']}"),
        )
        return BlendedMegatronDatasetBuilder(
            MegatronGPT, [samples, 0, 0], lambda: True, config
        ).build()[0]

    _report(
        "GPT index build+cache",
        _best(index_ours, repeats),
        _best(index_megatron, repeats),
        f"{samples} samples of {seq}+1",
    )
    ours, theirs = index_ours(), index_megatron()
    assert np.array_equal(ours.shuffle_index, theirs.shuffle_index)
    return ours, theirs


def _compare_reads(ours: Any, theirs: Any, reads: int, seq: int, repeats: int) -> None:
    ids = np.random.default_rng(1).integers(0, len(ours), size=reads)
    _report(
        "read samples",
        _best(lambda: [ours[int(i)] for i in ids], repeats),
        _best(lambda: [theirs[int(i)] for i in ids], repeats),
        f"{reads} random samples, {reads * seq / 1e6:.1f}M tokens",
    )


def _compare_blends(size: int, repeats: int) -> None:
    from megatron.core.datasets import helpers  # optional: dev extra

    for weights in ([0.3, 0.7], [0.3, 0.2, 0.5], [0.1, 0.1, 0.1, 0.3, 0.4], [0.31, 0.27, 0.42]):

        def blend_megatron(weights: list[float] = weights) -> None:
            index = np.zeros(size, dtype=np.int16)
            sample = np.zeros(size, dtype=np.int64)
            helpers.build_blending_indices(
                index, sample, np.array(weights), len(weights), size, False
            )

        ours_s, theirs_s = _best_interleaved(
            [lambda weights=weights: build_blending_indices(weights, size), blend_megatron],
            repeats,
        )
        _report("blend indices", ours_s, theirs_s, f"{size} samples, weights {weights}")


def _report_packing(corpus: list[np.ndarray], seq: int) -> None:
    """Fill of first-fit decreasing packing against in-order next-fit."""
    lengths = np.array([min(d.size, seq) for d in corpus])
    start = time.perf_counter()
    bins = first_fit(lengths, seq)
    ffd_s = time.perf_counter() - start
    next_fit, fill = 0, 0
    for n in lengths.tolist():
        if fill and fill + n > seq:
            next_fit, fill = next_fit + 1, 0
        fill += n
    next_fit += 1 if fill else 0
    print(
        f"packing fill           first-fit decreasing {packing_efficiency(lengths, bins, seq):.3f} "
        f"({len(bins)} rows, {ffd_s * 1e3:.0f} ms)   in-order next-fit "
        f"{lengths.sum() / (next_fit * seq):.3f} ({next_fit} rows)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the comparisons and print ours / megatron-core time ratios."""
    args = _parse_args(argv)
    docs = args.docs or (5_000 if args.quick else 100_000)
    reads = min(args.reads, 300) if args.quick else args.reads
    try:
        import torch

        # Every megatron-core module the comparisons use: a missing dev extra is reported once.
        from megatron.core.datasets import (  # noqa: F401
            blended_megatron_dataset_builder,
            gpt_dataset,
            helpers,
            indexed_dataset,
        )
    except ImportError as error:
        print(f"megatron-core is not installed ({error}); install the dev extras to compare")
        return 1
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    corpus = _corpus(docs)
    tokens = sum(d.size for d in corpus)
    seq = args.seq_length
    samples = args.samples or max(1, 3 * tokens // seq)  # about three epochs
    print(
        f"corpus: {docs} documents, {tokens} tokens (uint16); seq_length {seq}; "
        f"{samples} samples; best of {args.repeats}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _compare_writers(root, corpus, args.repeats)
        ours, theirs = _compare_indices(root, seq, samples, args.repeats)
        _compare_reads(ours, theirs, reads, seq, args.repeats)
        _compare_blends(args.blend_samples or min(samples, 200_000), args.repeats)
    _report_packing(corpus, seq)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
