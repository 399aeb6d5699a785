"""Weighted blend of several datasets (`--data-path 0.3 a 0.7 b`), Megatron's interleaving."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokendata.datasets.blend_order import blend_many, sample_ids
from tokendata.datasets.cache import CachedArraysMixin, IndexCache

try:  # the greedy loop in C, built at install time where a compiler is present (blend_loop.c)
    import tokendata.datasets.blend_loop as compiled_blend
except ImportError:  # pragma: no cover - exercised where the optional build was skipped
    compiled_blend = None


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample id within that dataset) for each of `size` blended samples.

    Each step serves the dataset furthest behind its target share (`weight * step - served`),
    the first one on ties: a deterministic interleave whose prefix of any length tracks the
    weights. Same arithmetic (doubles) and tie-breaking as megatron-core, so the order matches.
    Two datasets take a vectorised path with the identical result (`_blend_two`); three or more
    guess blocks of steps from the order's period and verify them exactly
    (`blend_order.blend_many`), falling back to the loop where that does not pay. Where the C
    loop was built at install (`blend_loop.c`, same arithmetic), it serves every case instead.
    """
    weights = [float(w) for w in weights]
    if compiled_blend is not None and 0 < len(weights) <= np.iinfo(np.int16).max:
        return compiled_order(weights, size)
    if len(weights) == 2 and size > 0:
        fast = _blend_two(weights[0], weights[1], size)
        if fast is not None:
            return fast
    if len(weights) > 2 and size > 0:
        picks = blend_many(weights, size)
        return picks.astype(np.int16), sample_ids(picks, len(weights))
    return _blend_loop(weights, size)


def compiled_order(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """`build_blending_indices` through the compiled loop (requires `compiled_blend`)."""
    if compiled_blend is None:
        raise RuntimeError("the compiled blend loop was not built (no C compiler at install)")
    picks = np.empty(size, dtype=np.int16)
    ids = np.empty(size, dtype=np.int64)
    compiled_blend.order(np.asarray(weights, dtype=np.float64).tobytes(), size, picks, ids)
    return picks, ids


def _blend_loop(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference: one step at a time."""
    served = [0] * len(weights)
    picks = [0] * size
    sample_ids = [0] * size
    others = range(1, len(weights))
    first = weights[0]
    # Plain Python lists and locals: this loop is the hot path (about 0.5 us per sample).
    for step in range(size):
        scale = float(step) if step > 1 else 1.0
        best, best_error = 0, first * scale - served[0]
        for i in others:
            error = weights[i] * scale - served[i]
            if error > best_error:
                best, best_error = i, error
        picks[step] = best
        sample_ids[step] = served[best]
        served[best] += 1
    return np.array(picks, dtype=np.int16), np.array(sample_ids, dtype=np.int64)


def _blend_two(w0: float, w1: float, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`_blend_loop` for two datasets without a Python loop per step (None: use the loop).

    With k samples of dataset 0 served by step s (so s - k of dataset 1), the step serves
    dataset 0 iff `cond(k, s)`: w0*scale - k >= w1*scale - (s - k), evaluated in the loop's
    doubles. For a fixed k, cond is monotone in s (false, then true for good): the left side
    never decreases and the right one falls by 1 - w1 per step, which the guard keeps above
    the rounding. So dataset 0's k-th sample goes to step S_k = max(S_{k-1} + 1, T_k), T_k the
    first step where cond(k, .) holds, and S = k + running max of (T - k). T_k comes from the
    real-number solution s >= 2k / (1 + w0 - w1), checked exactly at T_k - 1 and T_k.
    """
    if not (w0 >= 0 and w1 >= 0 and w1 + 4 * math.ulp(max(w1 * size, 1.0)) < 1.0):
        return None
    slope = 1.0 + w0 - w1
    count = min(size, math.ceil(size * slope / 2.0) + 2)
    k = np.arange(count, dtype=np.int64)
    first = np.ceil(k * (2.0 / slope)).astype(np.int64)
    off = np.flatnonzero(~_serves_first(w0, w1, k, first) | _serves_first(w0, w1, k, first - 1))
    for i in off.tolist():  # the estimate is off by rounding: walk to the first step that holds
        s = max(int(first[i]), 0)
        while s > 0 and _serves_first_at(w0, w1, i, s - 1):
            s -= 1
        while not _serves_first_at(w0, w1, i, s):
            s += 1
        first[i] = s
    starts = k + np.maximum.accumulate(first - k)
    starts = starts[: int(np.searchsorted(starts, size))]
    is_first = np.zeros(size, dtype=bool)
    is_first[starts] = True
    firsts_before = np.cumsum(is_first) - is_first
    sample_ids = np.where(is_first, firsts_before, np.arange(size) - firsts_before)
    return (~is_first).astype(np.int16), sample_ids


def _serves_first(w0: float, w1: float, k: np.ndarray, s: np.ndarray) -> np.ndarray:
    """cond(k, s) of `_blend_two` for arrays (False where s < 0)."""
    scale = np.maximum(s, 1).astype(np.float64)
    return (s >= 0) & ((w0 * scale - k) >= (w1 * scale - (s - k)))


def _serves_first_at(w0: float, w1: float, k: int, s: int) -> bool:
    scale = float(s) if s > 1 else 1.0
    return w0 * scale - k >= w1 * scale - (s - k)


def samples_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples to build from each dataset so a blend of `size` never runs short."""
    return [math.ceil(math.ceil(size * w) * (1 + surplus)) for w in weights]


class BlendedDataset(CachedArraysMixin, torch.utils.data.Dataset):
    """`size` samples interleaved from `datasets` in proportion to `weights` (normalised)."""

    dataset_index: np.ndarray
    dataset_sample_index: np.ndarray

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        cache: IndexCache | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(
                f"{len(datasets)} datasets but {len(weights)} weights; give one weight each"
            )
        if len(datasets) >= 32767:
            raise ValueError(f"{len(datasets)} datasets in one blend; at most 32766 are supported")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = size

        def build() -> dict[str, np.ndarray]:
            dataset_index, sample_index = build_blending_indices(self.weights, size)
            counts = np.bincount(dataset_index, minlength=len(self.datasets))
            for i, (needed, dataset) in enumerate(zip(counts, self.datasets, strict=True)):
                if needed > len(dataset):  # type: ignore[arg-type]
                    raise ValueError(
                        f"the blend draws {needed} samples from dataset {i} which has only "
                        f"{len(dataset)}; raise DataConfig.blend_surplus"  # type: ignore[arg-type]
                    )
            return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

        arrays = build() if cache is None else cache.get_or_build(build, group)
        self.adopt(arrays, cache)

    @staticmethod
    def describe(
        children: Sequence[dict[str, Any]], weights: Sequence[float], size: int
    ) -> dict[str, Any]:
        """What determines the blend order (the cache key)."""
        return {
            "class": "BlendedDataset",
            "datasets": list(children),
            "weights": list(weights),
            "size": size,
        }

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a blend of {len(self)} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
