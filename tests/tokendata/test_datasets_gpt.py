"""Pretraining samples and blends against megatron-core's GPTDataset / BlendedDataset."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from tokendata.datasets import (
    DataConfig,
    build_blending_indices,
    build_datasets,
    build_gpt_indices,
)
from tokendata.datasets.config import parse_split
from tokendata.indexed import IndexedDataset, IndexedDatasetWriter

mcore_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
mcore_builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
mcore_config = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")

EOD, PAD = 2, 1


class _MegatronTokenizer:
    """The attributes megatron-core's GPTDataset reads from a tokenizer."""

    vocab_size = 512
    eod = EOD
    pad = PAD
    unique_identifiers: ClassVar[dict[str, str]] = {"class": "_MegatronTokenizer"}


def _write_corpus(prefix: Path, num_docs: int, seed: int, empty_every: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    docs = []
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for i in range(num_docs):
            size = (
                0
                if empty_every and i % empty_every == empty_every - 1
                else int(rng.integers(1, 40))
            )
            doc = [*rng.integers(3, 500, size=size).tolist(), EOD] if size else []
            writer.add_document(doc)
            docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpt")
    _write_corpus(root / "a_text_document", 60, seed=0, empty_every=7)
    _write_corpus(root / "b_text_document", 25, seed=1)
    return {"a": str(root / "a_text_document"), "b": str(root / "b_text_document")}


def _megatron(blend, split: str, sizes, seq_length: int, seed: int, cache: Path | None, **flags):
    config = mcore_gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        tokenizer=_MegatronTokenizer(),
        reset_position_ids=flags.get("reset_position_ids", False),
        reset_attention_mask=flags.get("reset_attention_mask", False),
        eod_mask_loss=flags.get("eod_mask_loss", False),
        path_to_cache=None if cache is None else str(cache),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mcore_builder.BlendedMegatronDatasetBuilder(
            mcore_gpt.GPTDataset, list(sizes), lambda: True, config
        ).build()


def test_split_matches_megatron() -> None:
    for split in ("969,30,1", "90,8,2", "1,0,0", "50,50", "7"):
        ours = parse_split(split)
        vector = mcore_config.parse_and_normalize_split(split)
        theirs = mcore_config.convert_split_vector_to_split_matrix(vector)
        assert ours == theirs, split
    for bad in ("", "a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


@pytest.mark.parametrize(
    ("seq_length", "seed", "sizes"),
    [
        (16, 1234, (40, 6, 3)),  # under one epoch
        (8, 7, (400, 30, 10)),  # many epochs, last epoch shuffled with the rest
        (12, 99, (140, 12, 4)),  # a short last epoch shuffled on its own
    ],
)
def test_indices_and_samples_match_megatron(
    corpora, tmp_path: Path, seq_length, seed, sizes
) -> None:
    theirs = _megatron(([corpora["a"]], None), "90,8,2", sizes, seq_length, seed, tmp_path / "mc")
    config = DataConfig(data_path=[corpora["a"]], split="90,8,2", cache_dir=str(tmp_path / "ours"))
    ours = build_datasets(config, {"eod_id": EOD, "pad_id": PAD}, seq_length, seed, sizes)
    for mine, ref in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(mine.document_index, ref.document_index)
        np.testing.assert_array_equal(mine.sample_index, ref.sample_index)
        np.testing.assert_array_equal(mine.shuffle_index, ref.shuffle_index)
        assert (
            len(mine)
            == len(ref)
            >= sizes[
                0
                if ref.index_split.name == "train"
                else 1
                if ref.index_split.name == "valid"
                else 2
            ]
        )
        for idx in range(len(mine)):
            sample, expected = mine[idx], ref[idx]
            assert torch.equal(sample["input_ids"], expected["tokens"])
            assert torch.equal(sample["labels"], expected["labels"])
            assert torch.equal(sample["loss_mask"], expected["loss_mask"])
            assert torch.equal(sample["position_ids"], expected["position_ids"])


def test_eod_flags_match_megatron(corpora, tmp_path: Path) -> None:
    flags = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
    theirs = _megatron(([corpora["b"]], None), "1,0,0", (30, 0, 0), 16, 5, tmp_path / "mc", **flags)
    config = DataConfig(
        data_path=[corpora["b"]], split="1,0,0", cache_dir=str(tmp_path / "o"), **flags
    )
    train, valid, test = build_datasets(config, {"eod_id": EOD, "pad_id": PAD}, 16, 5, (30, 0, 0))
    assert valid is None and test is None
    for idx in range(len(train)):
        sample, expected = train[idx], theirs[0][idx]
        assert torch.equal(sample["position_ids"], expected["position_ids"])
        assert torch.equal(sample["loss_mask"], expected["loss_mask"])
        assert torch.equal(sample["labels"] == -100, expected["loss_mask"] == 0)
        # Megatron's attention mask blocks attending across an EOD; same-segment pairs are allowed.
        segments = sample["segment_ids"]
        same_segment = segments[:, None] == segments[None, :]
        causal = torch.ones(16, 16, dtype=torch.bool).tril()
        assert torch.equal(~expected["attention_mask"][0], same_segment & causal)


def test_weighted_blend_matches_megatron(corpora, tmp_path: Path) -> None:
    blend = ([corpora["a"], corpora["b"]], [0.3, 0.7])
    # megatron-core's BlendedDataset reads torch.distributed's rank whenever it has a cache
    # directory, so it runs uncached here (its GPTDatasets then cache beside the data).
    theirs = _megatron(blend, "90,8,2", (120, 12, 4), 8, 42, None)
    data_path = ["0.3", corpora["a"], "0.7", corpora["b"]]
    config = DataConfig(data_path=data_path, split="90,8,2", cache_dir=str(tmp_path / "o"))
    ours = build_datasets(config, {"eod_id": EOD, "pad_id": PAD}, 8, 42, (120, 12, 4))
    for mine, ref in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(mine.dataset_index, ref.dataset_index)
        np.testing.assert_array_equal(mine.dataset_sample_index, ref.dataset_sample_index)
        for idx in range(len(mine)):
            assert torch.equal(mine[idx]["input_ids"], ref[idx]["tokens"])


def test_samples_cross_documents_and_cover_the_stream(corpora) -> None:
    ds = IndexedDataset(corpora["b"])
    sizes = ds.sequence_lengths
    documents = np.arange(len(ds), dtype=np.int32)
    doc_index, sample_index, _ = build_gpt_indices(sizes, documents, 10, None, seed=3)
    stream = np.concatenate([ds[int(d)] for d in doc_index])
    for j in range(sample_index.shape[0] - 1):
        slot, offset = sample_index[j]
        start = int(sizes[doc_index[:slot]].sum()) + int(offset)
        assert start == 10 * j  # each sample starts seq_length tokens after the previous one
    assert (sample_index.shape[0] - 1) * 10 + 1 <= stream.size


def test_empty_split_raises_a_clear_error(corpora, tmp_path: Path) -> None:
    config = DataConfig(data_path=[corpora["b"]], split="969,30,1", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"test split.*--split"):
        build_datasets(config, {"eod_id": EOD}, 16, 1, (10, 2, 1))


def test_cache_is_reused_and_keyed_by_config(corpora, tmp_path: Path) -> None:
    config = DataConfig(data_path=[corpora["a"]], split="1,0,0", cache_dir=str(tmp_path))
    first = build_datasets(config, {"eod_id": EOD}, 16, 1, (20, 0, 0))[0]
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".npy")
    assert len(files) == 3
    again = build_datasets(config, {"eod_id": EOD}, 16, 1, (20, 0, 0))[0]
    assert isinstance(again.shuffle_index, np.memmap)  # loaded, not rebuilt
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)
    build_datasets(config, {"eod_id": EOD}, 16, 2, (20, 0, 0))
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".npy"]) == 6


def test_pickled_dataset_remaps_its_cached_indices(corpora, tmp_path: Path) -> None:
    config = DataConfig(data_path=[corpora["a"]], split="1,0,0", cache_dir=str(tmp_path))
    train = build_datasets(config, {"eod_id": EOD}, 8, 1, (2000, 0, 0))[0]
    payload = pickle.dumps(train)
    assert len(payload) < train.shuffle_index.nbytes  # paths travel, not the arrays
    clone = pickle.loads(payload)
    assert isinstance(clone.sample_index, np.memmap)
    for idx in (0, 17, len(train) - 1):
        assert torch.equal(clone[idx]["input_ids"], train[idx]["input_ids"])


def test_per_split_data_paths_match_megatron(corpora, tmp_path: Path) -> None:
    blend_per_split = [([corpora["a"]], None), ([corpora["b"]], None), None]
    config = mcore_gpt.GPTDatasetConfig(
        random_seed=9,
        sequence_length=8,
        blend_per_split=blend_per_split,
        tokenizer=_MegatronTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "mc"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = mcore_builder.BlendedMegatronDatasetBuilder(
            mcore_gpt.GPTDataset, [50, 10, 0], lambda: True, config
        ).build()
    ours_config = DataConfig(
        train_data_path=[corpora["a"]],
        valid_data_path=[corpora["b"]],
        cache_dir=str(tmp_path / "o"),
    )
    ours = build_datasets(ours_config, {"eod_id": EOD}, 8, 9, (50, 10, 0))
    assert ours[2] is None
    for mine, ref in zip(ours[:2], theirs[:2], strict=True):
        np.testing.assert_array_equal(mine.shuffle_index, ref.shuffle_index)
        np.testing.assert_array_equal(mine.sample_index, ref.sample_index)
        assert torch.equal(mine[3]["input_ids"], ref[3]["tokens"])
    with pytest.raises(ValueError, match="cannot be combined"):
        DataConfig(data_path=[corpora["a"]], train_data_path=[corpora["b"]])
    with pytest.raises(ValueError, match="--data-path is required"):
        build_datasets(DataConfig(), {"eod_id": EOD}, 8, 9, (5, 0, 0))


@pytest.mark.parametrize(
    "weights",
    [
        [0.3, 0.7],
        [0.5, 0.5],
        [0.9, 0.1],
        [0.0, 1.0],
        [1 / 3, 2 / 3],
        [1 / 3, 1 / 3, 1 / 3],
        [0.05, 0.15, 0.2, 0.6],
    ],
)
def test_blending_order_matches_megatron_helpers(weights: list[float]) -> None:
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    size = 20_000
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        dataset_index, sample_index, np.array(weights), len(weights), size, False
    )
    ours = build_blending_indices(weights, size)
    np.testing.assert_array_equal(ours[0], dataset_index)
    np.testing.assert_array_equal(ours[1], sample_index)


def test_two_dataset_blend_is_the_step_by_step_order() -> None:
    """The vectorised two-dataset path gives the reference loop's arrays for any weights and
    sizes (normalised or not, ties, zero weights, the first steps)."""
    from tokendata.datasets.blended import _blend_loop

    rng = np.random.default_rng(0)
    cases = [([0.3, 0.7], 1), ([0.3, 0.7], 2), ([0.5, 0.5], 3), ([0.0, 0.5], 500), ([1.0, 0.0], 50)]
    for i in range(120):
        w = rng.random(2)
        if i % 2:
            w = w / w.sum()
        if i % 5 == 0:
            w = np.round(w, 1)
        cases.append(([float(x) for x in w], int(rng.integers(1, 5000))))
    for weights, size in cases:
        expected, got = _blend_loop(weights, size), build_blending_indices(weights, size)
        for a, b in zip(expected, got, strict=True):
            assert a.dtype == b.dtype, (weights, size)
            np.testing.assert_array_equal(b, a, err_msg=f"{weights} {size}")
