"""Many documents to one token array: one conversion and one range check per batch.

The `.bin` writer's per-document cost used to be a handful of numpy calls (cast, range check,
copy) per document, which dominated for the short documents of a real corpus. Here a batch of
documents of one dtype is concatenated once, range-checked with one reduction and cast once;
`IndexedDatasetWriter.add_documents` feeds it slices of about `BATCH_TOKENS` tokens so the
intermediate arrays stay in cache.

The result is exactly what converting each document on its own gives: the same cast, the same
accepted and rejected inputs. Batches mixing several source dtypes (rare: say Python lists
next to int32 arrays) are left to the per-document path (`concat_tokens` returns None).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

BATCH_TOKENS = 1 << 17
"""Documents are converted in slices of about this many tokens: the int64 intermediate (1 MiB)
stays in L2 cache, which measured fastest of 32K-1M tokens at 100k documents."""


def as_arrays(documents: Sequence[Any]) -> list[np.ndarray]:
    """Each document as a numpy array (arrays pass through; lists are converted)."""
    return [d if type(d) is np.ndarray else np.asarray(d) for d in documents]


def document_sizes(arrays: Sequence[np.ndarray], where: str) -> np.ndarray:
    """Tokens per document (int64); ValueError naming the first document that is not 1-D."""
    if any(a.ndim != 1 for a in arrays):
        bad = next(i for i, a in enumerate(arrays) if a.ndim != 1)
        raise ValueError(
            f"{where}: a document must be a 1-D sequence of token ids, got shape "
            f"{arrays[bad].shape} (document {bad} of the batch)"
        )
    return np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))


def slice_bounds(sizes: np.ndarray, batch_tokens: int = BATCH_TOKENS) -> list[tuple[int, int]]:
    """`[start, stop)` document ranges of about `batch_tokens` tokens each (at least one doc)."""
    if sizes.size == 0:
        return []
    ends = np.cumsum(sizes)
    total = int(ends[-1])
    if total <= batch_tokens:
        return [(0, int(sizes.size))]
    cuts = np.searchsorted(ends, np.arange(batch_tokens, total, batch_tokens), side="left") + 1
    stops = np.unique(np.minimum(cuts, sizes.size)).tolist()
    if not stops or stops[-1] != sizes.size:
        stops.append(int(sizes.size))
    starts = [0, *stops[:-1]]
    return list(zip(starts, stops, strict=True))


def concat_tokens(arrays: Sequence[np.ndarray], dtype: np.dtype, where: str) -> np.ndarray | None:
    """The 1-D documents `arrays` concatenated and converted to `dtype` (None: mixed dtypes).

    Same acceptance as converting one document at a time: integer targets take integer (or
    bool) ids that fit, checked exactly; a float source into an integer target is rejected
    unless it is empty; float targets take any numeric input (a plain cast).
    """
    if not arrays:
        return np.zeros(0, dtype=dtype)
    source = arrays[0].dtype
    if any(a.dtype != source for a in arrays):
        return None
    if source == dtype:
        return np.concatenate(arrays)
    if np.can_cast(source, dtype):  # widening (uint16 -> int32, ...): cannot overflow
        return np.concatenate(arrays, dtype=dtype)
    if dtype.kind not in "iu":  # float targets: a plain cast, as the per-document path does
        return np.concatenate(arrays, dtype=dtype, casting="unsafe")
    flat = np.concatenate(arrays)
    if flat.size == 0:
        return flat.astype(dtype)
    if source.kind not in "iub":
        raise ValueError(f"{where}: token ids must be integers, got dtype {source}")
    info = np.iinfo(dtype)
    if dtype.kind == "u" and source.kind in "iu":
        # One reduction instead of min and max: all ids lie in [0, 2**bits) iff their bitwise
        # OR does (a negative id sets the sign bit, so the OR is negative).
        fits = 0 <= int(np.bitwise_or.reduce(flat)) <= int(info.max)
    else:
        fits = int(info.min) <= int(flat.min()) and int(flat.max()) <= int(info.max)
    if not fits:
        low, high = int(flat.min()), int(flat.max())
        raise ValueError(
            f"{where}: token ids span [{low}, {high}] which does not fit dtype {dtype.name} "
            f"{[int(info.min), int(info.max)]}; pick a wider dtype (best_dtype(vocab_size))"
        )
    return flat.astype(dtype)


MAX_SEQUENCE = (1 << 31) - 1
"""Longest sequence the index can hold (lengths are int32)."""


def batch_index(
    sizes: np.ndarray, lengths: Sequence[Sequence[int] | None] | None, base: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(int32 sequence lengths, int64 document boundaries) a batch appends to an index.

    `lengths[i]` splits document i (`sizes[i]` tokens) into sequences (None: one sequence);
    `base` is the number of sequences already in the index. ValueError names the first document
    whose lengths are negative or do not add up.
    """
    if lengths is None:
        _check_int32(sizes, where)
        return sizes.astype(np.int32), base + np.arange(1, sizes.size + 1, dtype=np.int64)
    totals = sizes.tolist()
    per_doc = [(totals[i],) if item is None else item for i, item in enumerate(lengths)]
    counts = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc))
    flat = np.fromiter(chain.from_iterable(per_doc), dtype=np.int64, count=int(counts.sum()))
    ends = np.cumsum(counts)
    running = np.concatenate(([0], np.cumsum(flat)))
    wrong = np.flatnonzero(running[ends] - running[ends - counts] != sizes)
    negative = np.flatnonzero(flat < 0)
    if wrong.size or negative.size:
        found = [int(wrong[0])] if wrong.size else []
        if negative.size:
            found.append(int(np.searchsorted(ends, negative[0], side="right")))
        doc = min(found)
        raise ValueError(
            f"{where}: sequence lengths {[int(n) for n in per_doc[doc]]} must be "
            f"non-negative and sum to the document's {totals[doc]} tokens "
            f"(document {doc} of the batch)"
        )
    _check_int32(flat, where)
    return flat.astype(np.int32), base + ends


def _check_int32(sequence_lengths: np.ndarray, where: str) -> None:
    if sequence_lengths.size and int(sequence_lengths.max()) > MAX_SEQUENCE:
        raise ValueError(
            f"{where}: a sequence of {int(sequence_lengths.max())} tokens exceeds the index's "
            f"int32 length ({MAX_SEQUENCE}); split the document into sequences (lengths=...)"
        )
