"""`build_datasets`: the train / valid / test datasets a `DataConfig` describes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tokendata.datasets.blended import BlendedDataset, samples_per_dataset
from tokendata.datasets.cache import IndexCache, default_cache_dir
from tokendata.datasets.config import (
    SPLIT_NAMES,
    DataConfig,
    parse_data_path,
    parse_split,
    split_document_range,
)
from tokendata.datasets.gpt import GPTDataset
from tokendata.datasets.instruction import InstructionDataset
from tokendata.datasets.samples import TokenInfo
from tokendata.datasets.sources import arrow_files, open_instruction, open_pretraining

Dataset = torch.utils.data.Dataset
_SplitDatasets = list[Dataset | None]


def _source_id(prefix: str) -> str:
    """Identity of a shard for cache keys: its absolute path and its index files' sizes/mtimes.

    Re-tokenising into the same prefix changes the key, so stale sample indices are not reused.
    """
    candidates = [f"{prefix}.idx", f"{prefix}_packed_input_ids_document.idx"]
    candidates += [str(p) for p in arrow_files(prefix) + arrow_files(f"{prefix}_packed")]
    stats = [
        (os.path.basename(c), os.stat(c).st_size, os.stat(c).st_mtime_ns)
        for c in candidates
        if os.path.isfile(c)
    ]
    return f"{os.path.abspath(prefix)}:{stats}"


def _build_one(
    config: DataConfig,
    prefix: str,
    bounds: list[tuple[float, float] | None],
    token_info: TokenInfo,
    seq_length: int,
    seed: int,
    sizes: Sequence[int | None],
    group: dist.ProcessGroup | None,
) -> _SplitDatasets:
    """The three split datasets of one prefix (None where the split is empty or not wanted)."""
    source_id = _source_id(prefix)
    cache_dir = default_cache_dir(prefix, config.cache_dir)
    stem = os.path.basename(prefix)
    if config.is_instruction_dataset:
        sources = open_instruction(prefix, config.data_format)
        count = len(sources.input_ids)
    else:
        token_source = open_pretraining(prefix, config.data_format)
        count = len(token_source)
    out: _SplitDatasets = []
    for name, bound, size in zip(SPLIT_NAMES, bounds, sizes, strict=True):
        if bound is None or size == 0:
            out.append(None)
            continue
        span = split_document_range(bound, count)
        if config.is_instruction_dataset:
            desc = InstructionDataset.describe(
                source_id, name, span, size, seq_length, seed, config.pack
            )
            out.append(
                InstructionDataset(
                    sources,
                    prefix,
                    name,
                    span,
                    size,
                    seq_length,
                    seed,
                    token_info,
                    pack=config.pack,
                    variable_seq_lengths=config.variable_seq_lengths,
                    cache=IndexCache(
                        cache_dir, f"{stem}-{name}", desc, ("row_offsets", "row_items", "order")
                    ),
                    group=group,
                )
            )
        else:
            desc = GPTDataset.describe(source_id, name, span, size, seq_length, seed)
            out.append(
                GPTDataset(
                    token_source,
                    prefix,
                    name,
                    span,
                    size,
                    seq_length,
                    seed,
                    token_info,
                    cache=IndexCache(
                        cache_dir,
                        f"{stem}-{name}",
                        desc,
                        ("document_index", "sample_index", "shuffle_index"),
                    ),
                    group=group,
                    reset_position_ids=config.reset_position_ids,
                    reset_attention_mask=config.reset_attention_mask,
                    eod_mask_loss=config.eod_mask_loss,
                )
            )
    return out


def build_datasets(
    config: DataConfig,
    tokenizer_info: Any,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None] = (None, None, None),
    group: dist.ProcessGroup | None = None,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """(train, valid, test) datasets; a split with no share in `--split` or 0 samples is None.

    `tokenizer_info` is the tokenizer (or its `describe()` dict) for the EOD and pad ids.
    `num_samples` are the samples each split must provide (None: one epoch). With several
    prefixes the splits are blends: weighted by `--data-path` weights, else by each dataset's
    one-epoch size. Index building runs once per `group` (rank 0 builds, the others wait) or,
    without a group, once per machine under a file lock.
    """
    if seq_length < 1:
        raise ValueError(f"--seq-length {seq_length} must be >= 1")
    if len(num_samples) != 3:
        raise ValueError(f"num_samples={num_samples!r} must give (train, valid, test)")
    token_info = TokenInfo.from_any(tokenizer_info)
    common = (token_info, seq_length, seed)
    per_split = config.per_split_paths()
    if per_split is None:
        bounds = parse_split(config.split)
        train, valid, test = _build_from(
            config, config.data_path, bounds, common, num_samples, group
        )
        return train, valid, test
    out: list[Dataset | None] = []
    for i, tokens in enumerate(per_split):
        # Megatron's --train/valid/test-data-path: each split reads all of its own datasets.
        bounds = [(0.0, 1.0) if j == i else None for j in range(3)]
        sizes = [num_samples[i] if j == i else 0 for j in range(3)]
        out.append(_build_from(config, tokens, bounds, common, sizes, group)[i] if tokens else None)
    return out[0], out[1], out[2]


def _build_from(
    config: DataConfig,
    data_path: list[str],
    bounds: list[tuple[float, float] | None],
    common: tuple[TokenInfo, int, int],
    num_samples: Sequence[int | None],
    group: dist.ProcessGroup | None,
) -> _SplitDatasets:
    """The three splits of one `--data-path` list (a blend when it names several prefixes)."""
    prefixes, weights = parse_data_path(data_path)
    if len(prefixes) == 1:
        return _build_one(config, prefixes[0], bounds, *common, num_samples, group)
    if weights is None:
        # An unweighted blend weighs each dataset by its one-epoch sample count in that split.
        epoch = [
            _build_one(config, p, bounds, *common, (None, None, None), group) for p in prefixes
        ]
        split_weights = [[float(_length(ds[i])) for ds in epoch] for i in range(3)]
    else:
        split_weights = [list(weights) for _ in range(3)]
    member_sizes = [
        _member_sizes(split_weights[i], num_samples[i], config.blend_surplus) for i in range(3)
    ]
    members = [
        _build_one(config, p, bounds, *common, [member_sizes[i][j] for i in range(3)], group)
        for j, p in enumerate(prefixes)
    ]
    return [
        _blend(
            config, name, prefixes, [m[i] for m in members], split_weights[i], num_samples[i], group
        )
        for i, name in enumerate(SPLIT_NAMES)
    ]


def _length(dataset: Dataset | None) -> int:
    return 0 if dataset is None else len(dataset)  # type: ignore[arg-type]


def _member_sizes(weights: list[float], size: int | None, surplus: float) -> list[int | None]:
    """Samples each blended dataset must index (None: one epoch)."""
    if size is None or sum(weights) == 0:
        return [None] * len(weights)
    total = sum(weights)
    return list(samples_per_dataset([w / total for w in weights], size, surplus))


def _blend(
    config: DataConfig,
    name: str,
    prefixes: list[str],
    parts: list[Dataset | None],
    weights: list[float],
    size: int | None,
    group: dist.ProcessGroup | None,
) -> Dataset | None:
    """One split's blend of the per-prefix datasets (None when the split is not wanted)."""
    if size == 0 or all(p is None for p in parts):
        return None
    missing = [prefix for prefix, part in zip(prefixes, parts, strict=True) if part is None]
    if missing or sum(weights) == 0:
        raise ValueError(
            f"the {name} split is empty for {missing or prefixes}; adjust --split or the blend"
        )
    normalised = [w / sum(weights) for w in weights]
    # Megatron serves sum(ceil(size * w)) samples, slightly more than asked, to keep each share.
    total = (
        sum(_length(p) for p in parts)
        if size is None
        else sum(samples_per_dataset(normalised, size))
    )
    children = [
        getattr(p, "description", None) or {"source": q}
        for p, q in zip(parts, prefixes, strict=True)
    ]
    cache = IndexCache(
        default_cache_dir(prefixes[0], config.cache_dir),
        f"blend-{name}",
        BlendedDataset.describe(children, normalised, total),
        ("dataset_index", "dataset_sample_index"),
    )
    return BlendedDataset(
        [p for p in parts if p is not None], normalised, total, cache=cache, group=group
    )
