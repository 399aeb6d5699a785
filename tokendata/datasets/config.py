"""What the trainer reads: `DataConfig` (Megatron/ModelLink data flags) and their parsing."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SPLIT_NAMES = ("train", "valid", "test")
DATA_FORMATS = ("auto", "mmap", "arrow")


@dataclass
class DataConfig:
    """Where the token shards are and how samples are drawn from them (`--data-path` & co.)."""

    data_path: list[str] = field(default_factory=list)
    """Megatron `--data-path`: prefixes, or `weight prefix weight prefix ...` to blend."""
    split: str = "969,30,1"
    """`--split`: train/valid/test proportions of each dataset's documents."""
    train_data_path: list[str] = field(default_factory=list)
    """`--train-data-path`: the train split's own datasets (instead of --data-path + --split)."""
    valid_data_path: list[str] = field(default_factory=list)
    """`--valid-data-path`: the validation split's own datasets."""
    test_data_path: list[str] = field(default_factory=list)
    """`--test-data-path`: the test split's own datasets."""
    is_instruction_dataset: bool = False
    """`--is-instruction-dataset`: read ModelLink's `{prefix}_packed_*_document` triples."""
    variable_seq_lengths: bool = False
    """`--variable-seq-lengths`: instruction samples are not padded; collate pads per batch."""
    pack: bool = False
    """`--pack`: first-fit pack instruction documents into `seq_length` rows (segment ids)."""
    data_format: str = "auto"
    """`--data-format`: "mmap" (.bin/.idx), "arrow" (IPC shards + manifest) or "auto" (detect)."""
    cache_dir: str | None = None
    """`--data-cache-path`: where sample indices are cached (default: a `cache/` beside the data)."""
    reset_position_ids: bool = False
    """`--reset-position-ids`: pretraining position ids restart after each EOD token."""
    reset_attention_mask: bool = False
    """`--reset-attention-mask`: emit `segment_ids` so attention stops at each EOD token."""
    eod_mask_loss: bool = False
    """`--eod-mask-loss`: no loss on predicting from an EOD token (next document's first token)."""
    blend_surplus: float = 0.005
    """Extra fraction of samples built per blended dataset so the blend never runs short."""

    def __post_init__(self) -> None:
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            value = getattr(self, name)
            setattr(
                self, name, [str(p) for p in (value.split() if isinstance(value, str) else value)]
            )
        if self.data_format not in DATA_FORMATS:
            raise ValueError(
                f"--data-format {self.data_format!r} is unknown; choose one of {list(DATA_FORMATS)}"
            )
        if self.pack and not self.is_instruction_dataset:
            raise ValueError(
                "--pack needs --is-instruction-dataset: pretraining samples already fill "
                "seq_length by crossing documents"
            )
        if self.blend_surplus < 0:
            raise ValueError(f"blend_surplus={self.blend_surplus} must be >= 0")
        parse_split(self.split)
        per_split = self.train_data_path or self.valid_data_path or self.test_data_path
        if self.data_path and per_split:
            raise ValueError(
                "--data-path cannot be combined with --train/valid/test-data-path; use --data-path "
                "with --split, or give each split its own paths"
            )
        for paths in (
            self.data_path,
            self.train_data_path,
            self.valid_data_path,
            self.test_data_path,
        ):
            if paths:
                parse_data_path(paths)

    def per_split_paths(self) -> list[list[str]] | None:
        """[train, valid, test] `--*-data-path` lists, or None when `--data-path` is used."""
        per_split = [self.train_data_path, self.valid_data_path, self.test_data_path]
        if self.data_path:
            return None
        if not any(per_split):
            raise ValueError("--data-path is required: the prefix(es) `meshline preprocess` wrote")
        return per_split

    def blend(self) -> tuple[list[str], list[float] | None]:
        """The parsed `--data-path`: prefixes and normalised weights (None when unweighted)."""
        return parse_data_path(self.data_path)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view (also the cache description)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataConfig:
        """Inverse of `to_dict`; unknown keys raise ValueError naming them."""
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown DataConfig fields {unknown}; known: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**dict(values))


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def parse_data_path(tokens: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """`["0.3", "a", "0.7", "b"]` -> (["a", "b"], [0.3, 0.7]); `["a", "b"]` -> (["a", "b"], None).

    Weights are normalised to sum to 1, as Megatron does.
    """
    tokens = [t.strip() for t in tokens if t.strip()]
    if not tokens:
        raise ValueError(
            "--data-path is empty; give one or more shard prefixes (optionally weighted)"
        )
    numeric = [_is_number(t) for t in tokens]
    if not any(numeric):
        return list(tokens), None
    if len(tokens) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise ValueError(
            f"--data-path {' '.join(tokens)!r} mixes weights and prefixes; write either "
            "'prefix1 prefix2' or 'w1 prefix1 w2 prefix2'"
        )
    weights = [float(w) for w in tokens[0::2]]
    if any(w <= 0 for w in weights):
        raise ValueError(f"--data-path weights {weights} must all be > 0")
    total = sum(weights)
    return list(tokens[1::2]), [w / total for w in weights]


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """`"969,30,1"` -> [(0, .969), (.969, .999), (.999, 1)]; an empty share gives None."""
    parts = [p for p in re.split(r"[,/\s]+", split.strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r} must be up to three numbers like '969,30,1'") from None
    if not values or len(values) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(
            f"--split {split!r} must be one to three non-negative numbers with a positive sum"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    bounds: list[tuple[float, float] | None] = []
    start = 0.0
    for value in values:
        end = start + value / total
        bounds.append((start, end) if value > 0 else None)
        start = end
    return bounds


def split_document_range(bounds: tuple[float, float], num_documents: int) -> tuple[int, int]:
    """The documents `[begin, end)` a split owns (Megatron rounds each bookend)."""
    return round(bounds[0] * num_documents), round(bounds[1] * num_documents)
