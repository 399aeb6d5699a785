"""PretrainingSampler: deterministic resume, disjoint data-parallel slices; DataLoader use."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from tokendata.datasets import DataConfig, PretrainingSampler, build_datasets, collate
from tokendata.indexed import IndexedDatasetWriter


def _stream(
    total: int, consumed: int, mbs: int, rank: int, dp: int, drop_last: bool = True
) -> list[list[int]]:
    return list(PretrainingSampler(total, consumed, mbs, rank, dp, drop_last=drop_last))


def test_single_rank_walks_the_dataset_in_order() -> None:
    assert _stream(10, 0, 3, 0, 1) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert _stream(10, 0, 3, 0, 1, drop_last=False) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(PretrainingSampler(10, 0, 3, 0, 1)) == 3
    assert len(PretrainingSampler(10, 0, 3, 0, 1, drop_last=False)) == 4


def test_data_parallel_ranks_partition_each_global_micro_batch() -> None:
    total, mbs, dp = 103, 4, 3
    streams = [_stream(total, 0, mbs, rank, dp) for rank in range(dp)]
    assert len({len(s) for s in streams}) == 1
    for step, batches in enumerate(zip(*streams, strict=True)):
        merged = [i for batch in batches for i in batch]
        assert merged == list(range(step * mbs * dp, (step + 1) * mbs * dp))
    assert len(streams[0]) == total // (mbs * dp)
    tails = [_stream(total, 96, mbs, rank, dp, drop_last=False)[-1] for rank in range(dp)]
    assert sorted(i for t in tails for i in t) == list(range(96, 103))


@pytest.mark.parametrize("consumed_batches", [0, 1, 5, 9])
def test_resume_from_consumed_samples_continues_the_exact_stream(consumed_batches: int) -> None:
    total, mbs, dp = 200, 2, 2
    for rank in range(dp):
        full = _stream(total, 0, mbs, rank, dp)
        resumed = _stream(total, consumed_batches * mbs * dp, mbs, rank, dp)
        assert resumed == full[consumed_batches:]


def test_bad_arguments_name_the_flag() -> None:
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, 11, 1, 0, 1)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        PretrainingSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        PretrainingSampler(10, 0, 1, 2, 2)


def test_dataloader_resume_yields_identical_batches(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "c_text_document", np.uint16) as writer:
        for _ in range(40):
            writer.add_document([*rng.integers(3, 300, size=int(rng.integers(2, 30))).tolist(), 2])
    config = DataConfig(data_path=[str(tmp_path / "c_text_document")], split="1,0,0")
    train = build_datasets(config, {"eod_id": 2, "pad_id": 0}, 16, 11, (48, 0, 0))[0]
    collate_fn = functools.partial(collate, variable_seq_lengths=False, pad_id=0)

    def batches(consumed: int, rank: int) -> list[torch.Tensor]:
        sampler = PretrainingSampler(len(train), consumed, 2, rank, 2)
        loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, collate_fn=collate_fn)
        return [b["input_ids"] for b in loader]

    for rank in range(2):
        full, resumed = batches(0, rank), batches(12, rank)
        assert full[0].shape == (2, 16)
        assert len(resumed) == len(full) - 3
        for a, b in zip(full[3:], resumed, strict=True):
            assert torch.equal(a, b)
    rank0, rank1 = batches(0, 0), batches(0, 1)
    for a, b in zip(rank0, rank1, strict=True):
        assert not torch.equal(a, b)
