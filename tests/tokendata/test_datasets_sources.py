"""Arrow and mmap shards written by the preprocess sinks read back identically; unweighted blends."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tokendata.datasets import DataConfig, build_datasets, open_pretraining
from tokendata.datasets.config import parse_data_path
from tokendata.datasets.sources import arrow_files

sinks = pytest.importorskip("services.preprocess.outputs")
arrow_sink = pytest.importorskip("services.preprocess.arrow_sink")
handlers = pytest.importorskip("services.preprocess.handlers")

INFO = {"eod_id": 2, "pad_id": 0}


def _documents(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        np.append(rng.integers(3, 400, size=int(rng.integers(1, 30))), 2).astype(np.int32)
        for _ in range(count)
    ]


def _write_both(root: Path, keys: tuple[str, ...], rows: list[tuple[dict, list[int]]]) -> None:
    mmap = sinks.MmapSink(root / "m", keys, vocab_size=512)
    arrow = arrow_sink.ArrowSink(root / "a", keys, {"test": True}, shard_bytes=512, batch_rows=4)
    for arrays, lengths in rows:
        per_key = {key: lengths for key in keys}
        mmap.add(arrays, per_key)
        arrow.add(arrays, per_key)
    mmap.finalize()
    arrow.finalize()


def test_pretraining_arrow_and_mmap_give_identical_samples(tmp_path: Path) -> None:
    docs = _documents(0, 30)
    rows = [({"text": d}, [d.size]) for d in docs[:20]]
    # A pre-packed document holding three sequences, as `--pack` writes them.
    rows.append(({"text": np.concatenate(docs[20:23])}, [d.size for d in docs[20:23]]))
    rows += [({"text": d}, [d.size]) for d in docs[23:]]
    _write_both(tmp_path, ("text",), rows)
    assert len(arrow_files(str(tmp_path / "a_text_document"))) > 1  # split by size
    mmap_source = open_pretraining(str(tmp_path / "m_text_document"))
    arrow_source = open_pretraining(str(tmp_path / "a_text_document"))
    np.testing.assert_array_equal(mmap_source.sequence_lengths, arrow_source.sequence_lengths)
    np.testing.assert_array_equal(mmap_source.document_indices, arrow_source.document_indices)
    for i in range(len(mmap_source)):
        np.testing.assert_array_equal(mmap_source.get(i), arrow_source.get(i))
    assert arrow_source.get(3, 1, 2).tolist() == docs[3][1:3].tolist()
    datasets = []
    for name in ("m", "a"):
        config = DataConfig(data_path=[str(tmp_path / f"{name}_text_document")], split="9,1,0")
        datasets.append(build_datasets(config, INFO, 8, 5, (50, 5, 0)))
    for ours, theirs in zip(*datasets, strict=True):
        if ours is None:
            assert theirs is None
            continue
        for idx in range(len(ours)):
            assert torch.equal(ours[idx]["input_ids"], theirs[idx]["input_ids"])


def test_instruction_arrow_and_mmap_give_identical_rows(tmp_path: Path) -> None:
    keys = handlers.INSTRUCTION_KEYS
    rows = []
    for doc in _documents(1, 12):
        labels = doc.copy()
        labels[: doc.size // 2] = -100
        arrays = {keys[0]: doc, keys[1]: np.ones_like(doc), keys[2]: labels}
        rows.append((arrays, [doc.size]))
    _write_both(tmp_path, keys, rows)
    built = []
    for name in ("m", "a"):
        config = DataConfig(
            data_path=[str(tmp_path / name)], split="1,0,0", is_instruction_dataset=True, pack=True
        )
        built.append(build_datasets(config, INFO, 32, 3, (None, 0, 0))[0])
    ours, theirs = built
    assert len(ours) == len(theirs) > 0
    for idx in range(len(ours)):
        for key, value in ours[idx].items():
            assert torch.equal(value, theirs[idx][key]), key


def test_unweighted_blend_weighs_by_dataset_size(tmp_path: Path) -> None:
    for name, seed, count in (("big", 2, 60), ("small", 3, 15)):
        (tmp_path / name).mkdir()
        _write_both(
            tmp_path / name, ("text",), [({"text": d}, [d.size]) for d in _documents(seed, count)]
        )
    prefixes = [str(tmp_path / name / "m_text_document") for name in ("big", "small")]
    tokens = [open_pretraining(p).sequence_lengths.sum() for p in prefixes]
    assert parse_data_path(prefixes) == (prefixes, None)
    config = DataConfig(data_path=prefixes, split="1,0,0", cache_dir=str(tmp_path / "cache"))
    train = build_datasets(config, INFO, 8, 1, (200, 0, 0))[0]
    share = np.bincount(np.asarray(train.dataset_index), minlength=2) / len(train)
    sizes = [len(d) for d in train.datasets]
    assert len(train) >= 200
    # Weights are the one-epoch sample counts, i.e. proportional to tokens (within a sample each).
    assert abs(share[0] - tokens[0] / sum(tokens)) < 0.02
    for dataset_id, sample_id in zip(train.dataset_index, train.dataset_sample_index, strict=True):
        assert sample_id < sizes[dataset_id]
    with pytest.raises(ValueError, match="mixes weights and prefixes"):
        parse_data_path(["0.5", "a", "b"])
    with pytest.raises(ValueError, match="> 0"):
        parse_data_path(["0", "a", "1", "b"])


def test_arrow_source_pickles_by_path(tmp_path: Path) -> None:
    docs = _documents(4, 10)
    _write_both(tmp_path, ("text",), [({"text": d}, [d.size]) for d in docs])
    source = open_pretraining(str(tmp_path / "a_text_document"))
    clone = pickle.loads(pickle.dumps(source))
    assert len(pickle.dumps(source)) < 1000
    for i in range(len(docs)):
        np.testing.assert_array_equal(clone.get(i), docs[i])
