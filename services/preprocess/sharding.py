"""Input sharding for preprocessing across many pods (`--num-shards N --shard-index I`).

Every pod resolves `--input` the same way (directories and globs sorted, explicit files in the
order given), so all of them see the same ordered file list. Shard `I` takes a *contiguous*
range of that list; the ranges are chosen so that each holds about `total_bytes / N` bytes
(boundary `k` is the file boundary nearest to `k * total / N`), and every shard gets at least
one file. Contiguous ranges make "shard 0, then shard 1, ..." the same document order as one
process over all inputs, so merging the shards in index order gives byte-identical `.bin/.idx`
files (`services/preprocess/merge.py`).

The shard's outputs go under `shard_prefix(output_prefix, I, N)`, so one command line (with
`JOB_COMPLETION_INDEX` as the default shard index) runs unchanged in every pod of a
Kubernetes Indexed Job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.preprocess.readers import InputPlan

SHARD_INDEX_ENV = "JOB_COMPLETION_INDEX"


def shard_prefix(output_prefix: str | os.PathLike[str], shard_index: int, num_shards: int) -> str:
    """The output prefix of one shard: `{prefix}-shard-00001-of-00003` (the prefix itself for N=1)."""
    prefix = os.fspath(output_prefix)
    if num_shards == 1:
        return prefix
    return f"{prefix}-shard-{shard_index:05d}-of-{num_shards:05d}"


def shard_prefixes(output_prefix: str | os.PathLike[str], num_shards: int) -> list[str]:
    """Every shard's output prefix, in merge order."""
    return [shard_prefix(output_prefix, i, num_shards) for i in range(num_shards)]


def default_shard_index(
    shard_index: int | None, num_shards: int, environ: Mapping[str, str] | None = None
) -> int:
    """`--shard-index`, else `$JOB_COMPLETION_INDEX`, else 0 for an unsharded run.

    ValueError naming the flag or variable when neither is usable for `num_shards > 1`.
    """
    if shard_index is not None:
        return shard_index
    env = os.environ if environ is None else environ
    raw = env.get(SHARD_INDEX_ENV)
    if raw is None or raw == "":
        if num_shards == 1:
            return 0
        raise ValueError(
            f"--shard-index: missing for --num-shards {num_shards}; pass --shard-index I or set "
            f"{SHARD_INDEX_ENV} (a Kubernetes Indexed Job sets it in every pod)"
        )
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{SHARD_INDEX_ENV}={raw!r} is not an integer; unset it or pass --shard-index"
        ) from None


def check_shard(shard_index: int, num_shards: int) -> None:
    """ValueError naming the flag unless `0 <= shard_index < num_shards`."""
    if num_shards < 1:
        raise ValueError(f"--num-shards: must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(
            f"--shard-index {shard_index} is out of range for --num-shards {num_shards}; "
            f"use 0..{num_shards - 1} (or set {SHARD_INDEX_ENV})"
        )


def split_ranges(sizes: Sequence[int], num_shards: int) -> list[tuple[int, int]]:
    """Contiguous `[start, stop)` file ranges, one per shard, balanced by bytes, none empty."""
    count = len(sizes)
    if num_shards > count:
        raise ValueError(
            f"--num-shards {num_shards}: only {count} input file(s) to split (a shard is whole "
            f"files); use --num-shards {max(count, 1)} or fewer, or split the corpus into more files"
        )
    cumulative = [0]
    for size in sizes:
        cumulative.append(cumulative[-1] + max(int(size), 0))
    total = cumulative[-1]
    bounds = [0]
    for k in range(1, num_shards):
        target = total * k / num_shards if total else count * k / num_shards
        marks = cumulative if total else list(range(count + 1))
        low, high = bounds[-1] + 1, count - (num_shards - k)
        best = min(range(low, high + 1), key=lambda b: (abs(marks[b] - target), b))
        bounds.append(best)
    bounds.append(count)
    return [(bounds[i], bounds[i + 1]) for i in range(num_shards)]


def shard_range(plans: list[InputPlan], shard_index: int, num_shards: int) -> tuple[int, int]:
    """`[start, stop)` of shard `shard_index` in the ordered files of the resolved `--input`."""
    check_shard(shard_index, num_shards)
    hf = [plan.hf_dataset for plan in plans if plan.hf_dataset is not None]
    if hf:
        raise ValueError(
            f"--num-shards: {hf[0]} is a HF dataset, which cannot be split by file; shard local "
            "files (.jsonl, .parquet, ...) or export the dataset to files first"
        )
    files: list[Path] = [path for plan in plans for path in plan.files]
    return split_ranges([path.stat().st_size for path in files], num_shards)[shard_index]


def shard_plans(plans: list[InputPlan], shard_index: int, num_shards: int) -> list[InputPlan]:
    """The part of the resolved `--input` plans that shard `shard_index` reads."""
    check_shard(shard_index, num_shards)
    if num_shards == 1:
        return plans
    start, stop = shard_range(plans, shard_index, num_shards)
    files = [path for plan in plans for path in plan.files]
    return [InputPlan(files=tuple(files[start:stop]))]
