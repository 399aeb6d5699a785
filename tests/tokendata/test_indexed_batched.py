"""`IndexedDatasetWriter.add_documents` (the batched path `meshline preprocess` runs) writes the
same bytes as one `add_document` per document and as megatron-core's `IndexedDatasetBuilder`."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import numpy as np
import pytest

import tokendata.indexed as indexed
from tokendata.indexed import IndexedDataset, IndexedDatasetWriter, bin_path, idx_path
from tokendata.token_batches import slice_bounds

megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _awkward(dtype: np.dtype, rng: np.random.Generator) -> tuple[list, list]:
    """Documents and per-document sequence lengths that stress every branch of the batch path."""
    high = int(min(np.iinfo(dtype).max, 60000)) if dtype.kind in "iu" else 60000
    huge = rng.integers(0, high, size=2_500_000)  # one document larger than a slice
    docs: list = [
        [],  # an empty Python list (numpy reads it as float64)
        rng.integers(0, high, size=5).tolist(),
        np.zeros(0, dtype=np.int64),
        huge,
        rng.integers(0, high, size=17).astype(np.int32),
        np.array([high, 0, 1], dtype=np.int64),
        rng.integers(0, min(high, 255), size=9).astype(np.uint8),
        np.array([True, False, True]),
        rng.integers(0, high, size=64).tolist(),
        rng.integers(0, high, size=12),
        [],
    ]
    lengths: list = [None] * len(docs)
    lengths[0] = []  # no sequences at all
    lengths[3] = [1_000_000, 0, 1_500_000]  # a boundary, an empty sequence, a boundary
    lengths[8] = [10, 0, 50, 4]
    lengths[9] = [12]
    lengths[10] = [0]
    return docs, lengths


def _write_per_document(prefix: Path, dtype: np.dtype, docs: list, lengths: list) -> None:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc, sizes in zip(docs, lengths, strict=True):
            writer.add_document(doc, lengths=sizes)


def _write_megatron(prefix: Path, dtype: np.dtype, docs: list, lengths: list) -> None:
    builder = megatron_indexed.IndexedDatasetBuilder(str(bin_path(prefix)), dtype=dtype.type)
    for doc, sizes in zip(docs, lengths, strict=True):
        array = np.asarray(doc, dtype=np.int64)
        builder.add_document(array, [array.size] if sizes is None else sizes)
    builder.finalize(str(idx_path(prefix)))


def _same_files(a: Path, b: Path) -> bool:
    return (
        bin_path(a).read_bytes() == bin_path(b).read_bytes()
        and idx_path(a).read_bytes() == idx_path(b).read_bytes()
    )


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8, np.float32])
@pytest.mark.parametrize("batch_tokens", [7, 1 << 20])
def test_batched_writer_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: type, batch_tokens: int
) -> None:
    dtype = np.dtype(dtype)
    monkeypatch.setattr(
        indexed, "slice_bounds", functools.partial(slice_bounds, batch_tokens=batch_tokens)
    )
    docs, lengths = _awkward(dtype, np.random.default_rng(3))
    _write_per_document(tmp_path / "single", dtype, docs, lengths)
    with IndexedDatasetWriter(tmp_path / "batched", dtype) as writer:
        writer.add_documents(docs[:4], lengths[:4])  # several calls, one of a single document
        writer.add_documents(docs[4:5], lengths[4:5])
        writer.add_documents(docs[5:])  # no lengths: one sequence per document
    expected = lengths[:5] + [None] * (len(docs) - 5)
    _write_per_document(tmp_path / "single2", dtype, docs, expected)
    assert _same_files(tmp_path / "batched", tmp_path / "single2")
    with IndexedDatasetWriter(tmp_path / "batched2", dtype) as writer:
        writer.add_documents(docs, lengths)
    assert _same_files(tmp_path / "batched2", tmp_path / "single")
    _write_megatron(tmp_path / "theirs", dtype, docs, lengths)
    assert _same_files(tmp_path / "batched2", tmp_path / "theirs")
    reader = megatron_indexed.IndexedDataset(str(tmp_path / "batched2"))
    assert (
        reader.document_indices.tolist()
        == IndexedDataset(tmp_path / "single").document_indices.tolist()
    )
    np.testing.assert_array_equal(reader[2], docs[3][:1_000_000].astype(dtype))  # doc 0: none
    np.testing.assert_array_equal(
        IndexedDataset(tmp_path / "batched2").document(3), docs[3].astype(dtype)
    )


def test_batched_range_check_matches_per_document(tmp_path: Path) -> None:
    """Every edge of every source/target integer pair is accepted or rejected as by
    `add_document`, and a rejected batch adds nothing."""
    sources = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
    for src in sources:
        s = np.iinfo(src)
        for dst in (np.uint8, np.uint16, np.int8, np.int16, np.int32, np.int64):
            d = np.iinfo(dst)
            bounds = (int(d.min), int(d.max))
            edges = {0, 1, -1, s.min, s.max, *bounds, bounds[0] - 1, bounds[1] + 1}
            writer = IndexedDatasetWriter(tmp_path / "r", dst)
            good = np.array([3, 0], dtype=src)
            for v in sorted(e for e in edges if s.min <= e <= s.max):
                batch = [good, np.array([3, v, 0], dtype=src), good]
                if bounds[0] <= v <= bounds[1]:
                    writer.add_documents(batch)
                else:
                    with pytest.raises(ValueError, match="does not fit"):
                        writer.add_documents(batch)
            accepted = [v for v in edges if s.min <= v <= s.max and bounds[0] <= v <= bounds[1]]
            assert writer.num_documents == 3 * len(accepted)
            writer.abort()


def test_rejected_batches_add_nothing(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "w", np.uint16) as writer:
        writer.add_documents([[1, 2]])
        with pytest.raises(ValueError, match=r"70000.*uint16.*best_dtype"):
            writer.add_documents([[5], [1, 70000]])
        with pytest.raises(ValueError, match=r"1-D.*document 1 of the batch"):
            writer.add_documents([[5], [[1, 2]]])
        with pytest.raises(ValueError, match=r"sum to the document's 2 tokens.*document 1"):
            writer.add_documents([[5], [1, 2]], [None, [3]])
        with pytest.raises(ValueError, match="non-negative"):
            writer.add_documents([[5, 6]], [[3, -1]])
        with pytest.raises(ValueError, match="2 documents but 1 length lists"):
            writer.add_documents([[5], [6]], [[1]])
        with pytest.raises(ValueError, match="integers"):
            writer.add_documents([np.array([1.5])])
        writer.add_documents([np.array([3, 4], dtype=np.int64)], [[1, 1]])
    ds = IndexedDataset(tmp_path / "w")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4]]
    assert ds.document_indices.tolist() == [0, 1, 3] and ds.num_tokens == 4


def test_batched_documents_are_copied(tmp_path: Path) -> None:
    mine = np.array([7, 8, 9], dtype=np.uint16)
    same = np.array([1, 2], dtype=np.uint16)
    with IndexedDatasetWriter(tmp_path / "c", np.uint16) as writer:
        writer.add_documents([mine, same])
        mine[:] = 0
        same[:] = 0
    ds = IndexedDataset(tmp_path / "c")
    assert ds[0].tolist() == [7, 8, 9] and ds[1].tolist() == [1, 2]


def test_slice_bounds_cover_every_document_in_order() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 50, size=1000)
    sizes[10] = 5000
    for batch in (1, 7, 100, 1 << 20):
        bounds = slice_bounds(sizes, batch)
        assert bounds[0][0] == 0 and bounds[-1][1] == sizes.size
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(bounds))
        for start, stop in bounds:  # only a slice of one document may exceed the budget
            assert stop - start == 1 or sizes[start : stop - 1].sum() < batch
    assert slice_bounds(np.zeros(0, dtype=np.int64)) == []
    assert slice_bounds(np.zeros(3, dtype=np.int64)) == [(0, 3)]
