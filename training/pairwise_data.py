"""The data of the preference stages (--stage rm / dpo): pairwise shards as padded pair batches.

One output prefix of `meshline preprocess` with a pairwise handler, split into train and valid
pairs by --split (`--data-path PREFIX`), or a prefix per split (`--train-data-path`,
`--valid-data-path`). Blends of several prefixes are not built for pairs yet and are refused.
"""

from __future__ import annotations

from typing import Any

from models.tokenizer import build_tokenizer
from tokendata.datasets.config import parse_split, split_document_range
from tokendata.datasets.pairwise import PairSource, PairwiseDataset
from training.batching import stack_samples
from training.config import TrainingConfig


def build_pairwise_data(
    config: TrainingConfig, dp_size: int
) -> tuple[tuple[Any, Any], int | None, Any]:
    """(train, valid) `PairwiseDataset`s, the tokenizer's vocabulary size, collate fn."""
    run, batch, data = config.run, config.batch, config.data
    stage = f"--stage {run.stage}"
    if data.mock_data:
        raise ValueError(f"{stage} trains on preference pairs; --mock-data has none")
    for flag, paths in (
        ("--data-path", data.data_path),
        ("--train-data-path", data.train_data_path),
        ("--valid-data-path", data.valid_data_path),
    ):
        if len(paths) > 1:
            raise ValueError(
                f"{flag} {' '.join(paths)}: {stage} reads one pairwise prefix per split "
                "(blends of pairwise shards are not built); give one prefix"
            )
    source_path = data.tokenizer_model or data.tokenizer_name_or_path
    if data.tokenizer_type is None or source_path is None:
        raise ValueError(
            "--data-path needs --tokenizer-type and --tokenizer-model or --tokenizer-name-or-path "
            "(the pad id and vocabulary of the pairs)"
        )
    tokenizer = build_tokenizer(
        data.tokenizer_type, source_path, use_fast=not data.tokenizer_not_use_fast
    )
    global_batch = batch.global_batch_size or batch.micro_batch_size * dp_size
    train_samples = run.train_iters * global_batch
    valid_samples = max(run.eval_iters, 1) * batch.micro_batch_size * dp_size
    seq, pad = config.model.seq_length, tokenizer.pad_id

    def dataset(source: PairSource, pairs: tuple[int, int], samples: int, seed: int) -> Any:
        return PairwiseDataset(source, pairs, seq, pad, samples, seed)

    valid = None
    if data.data_path:
        source = PairSource(data.data_path[0], data.data_format)
        bounds = parse_split(data.split)
        if bounds[0] is None:
            raise ValueError(f"--split {data.split} leaves no training pairs")
        train = dataset(
            source, split_document_range(bounds[0], len(source)), train_samples, run.seed
        )
        if run.eval_interval:
            if bounds[1] is None:
                raise ValueError(
                    f"--split {data.split} leaves no validation pairs; give the second split a "
                    "share, or pass --eval-interval 0"
                )
            span = split_document_range(bounds[1], len(source))
            valid = dataset(source, span, valid_samples, run.seed + 1)
    else:
        source = PairSource(data.train_data_path[0], data.data_format)
        train = dataset(source, (0, len(source)), train_samples, run.seed)
        if run.eval_interval:
            if not data.valid_data_path:
                raise ValueError(
                    "no validation pairs: pass --valid-data-path, or --eval-interval 0"
                )
            valid_source = PairSource(data.valid_data_path[0], data.data_format)
            valid = dataset(valid_source, (0, len(valid_source)), valid_samples, run.seed + 1)
    return (train, valid), tokenizer.vocab_size, stack_samples
