"""`.bin/.idx` shards against megatron-core's `IndexedDataset` / `IndexedDatasetBuilder`."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tokendata.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    bin_path,
    dataset_prefix,
    idx_path,
)

megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Meshline tokenises corpora into Megatron shards.",
    "",
    "Pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow. " * 5,
]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory):
    """A real sentencepiece model trained on a tiny corpus (vocab 128)."""
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("spm")
    text = root / "corpus.txt"
    text.write_text("\n".join(line for line in CORPUS * 20 if line) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(root / "sp"),
        vocab_size=128,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(root / "sp.model"))


def _megatron_write(prefix: Path, docs: list[list[int]], dtype: np.dtype) -> None:
    builder = megatron_indexed.IndexedDatasetBuilder(str(bin_path(prefix)), dtype=dtype.type)
    for doc in docs:
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(str(idx_path(prefix)))


def test_best_dtype_matches_megatron() -> None:
    for vocab in (128, 32000, 65499, 65500, 152064, None):
        assert best_dtype(vocab).type is megatron_indexed.DType.optimal_dtype(vocab)


def test_dataset_prefix_is_megatron_naming(tmp_path: Path) -> None:
    assert dataset_prefix(tmp_path / "alpaca", "text") == f"{tmp_path}/alpaca_text_document"
    with pytest.raises(ValueError, match="level"):
        dataset_prefix("x", "text", "paragraph")


def test_megatron_reads_tokenizer_ids_exactly(tmp_path: Path, sp_model) -> None:
    docs = [[*sp_model.encode(text), sp_model.eos_id()] for text in CORPUS]
    dtype = best_dtype(sp_model.get_piece_size())
    assert dtype == np.uint16
    prefix = dataset_prefix(tmp_path / "corpus", "text")
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    reference = megatron_indexed.IndexedDataset(prefix)
    assert len(reference) == len(docs)
    assert reference.index.dtype is np.uint16
    assert reference.document_indices.tolist() == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert reference[i].tolist() == doc
        assert sp_model.decode(reference[i].tolist()[:-1]) == CORPUS[i].strip()
    assert reference.get(4, offset=3, length=5).tolist() == docs[4][3:8]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_bytes_identical_to_megatron_builder(tmp_path: Path, dtype: type) -> None:
    rng = np.random.default_rng(0)
    high = min(np.iinfo(dtype).max, 70000)
    docs = [rng.integers(0, high, size=n).tolist() for n in (5, 0, 17, 1, 64)]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    writer = IndexedDatasetWriter(ours, dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    _megatron_write(theirs, docs, np.dtype(dtype))
    assert bin_path(ours).read_bytes() == bin_path(theirs).read_bytes()
    assert idx_path(ours).read_bytes() == idx_path(theirs).read_bytes()


def test_multi_sequence_documents_match_megatron(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    documents = [([1, 2, 3, 4, 5, 6], [2, 4]), ([7, 8, 9], [3]), ([10, 11], [1, 1])]
    writer = IndexedDatasetWriter(ours, np.uint16)
    builder = megatron_indexed.IndexedDatasetBuilder(str(bin_path(theirs)), dtype=np.uint16)
    for ids, lengths in documents:
        writer.add_document(ids, lengths=lengths)
        builder.add_document(np.array(ids), lengths)
    writer.finalize()
    builder.finalize(str(idx_path(theirs)))
    assert idx_path(ours).read_bytes() == idx_path(theirs).read_bytes()
    assert bin_path(ours).read_bytes() == bin_path(theirs).read_bytes()
    reference = megatron_indexed.IndexedDataset(str(ours))
    assert [seq.tolist() for seq in reference[0:5]] == [[1, 2], [3, 4, 5, 6], [7, 8, 9], [10], [11]]
    assert reference.document_indices.tolist() == [0, 2, 3, 5]
    ds = IndexedDataset(ours)
    assert ds.num_documents == 3 and len(ds) == 5
    assert ds.document(0).tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="sum to"):
        IndexedDatasetWriter(tmp_path / "bad", np.uint16).add_document([1, 2], lengths=[3])


def test_reader_reads_megatron_builder_output(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 150000, size=n).tolist() for n in (3, 40, 0, 9)]
    _megatron_write(tmp_path / "m", docs, np.dtype(np.int32))
    ds = IndexedDataset(tmp_path / "m")
    reference = megatron_indexed.IndexedDataset(str(tmp_path / "m"))
    assert ds.dtype == np.int32 and len(ds) == len(reference) == 4
    np.testing.assert_array_equal(ds.sequence_lengths, reference.sequence_lengths)
    np.testing.assert_array_equal(ds.document_indices, reference.document_indices)
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i], reference[i])
    np.testing.assert_array_equal(ds.get(1, 10, 7), reference.get(1, 10, 7))
    np.testing.assert_array_equal(ds.get(1, 35), reference.get(1, 35))
    assert ds[-1].tolist() == docs[-1]
    assert ds.num_tokens == 52


def test_add_index_merges_like_megatron(tmp_path: Path) -> None:
    parts = [[[1, 2, 3], [4]], [[5, 6], [7, 8, 9, 10]]]
    for n, docs in enumerate(parts):
        with IndexedDatasetWriter(tmp_path / f"part{n}", np.uint16) as writer:
            for doc in docs:
                writer.add_document(doc)
    merged = IndexedDatasetWriter(tmp_path / "merged", np.uint16)
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for n in range(len(parts)):
        merged.add_index(tmp_path / f"part{n}")
        builder.add_index(str(tmp_path / f"part{n}"))
    merged.finalize()
    builder.finalize(str(tmp_path / "ref.idx"))
    assert (tmp_path / "merged.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert IndexedDataset(tmp_path / "merged")[3].tolist() == [7, 8, 9, 10]
    with pytest.raises(ValueError, match="dtype"):
        IndexedDatasetWriter(tmp_path / "wide", np.int32).add_index(tmp_path / "part0")


def test_partial_files_never_look_complete(tmp_path: Path) -> None:
    prefix = tmp_path / "shard"
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.add_document([1, 2, 3])
    assert not IndexedDataset.exists(prefix)
    with pytest.raises(FileNotFoundError, match="missing"):
        IndexedDataset(prefix)
    writer.finalize()
    assert IndexedDataset.exists(prefix)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin", "shard.idx"]
    with pytest.raises(RuntimeError, match="already finalized"):
        writer.add_document([4])

    with pytest.raises(KeyError), IndexedDatasetWriter(tmp_path / "failed", np.uint16) as failing:
        failing.add_document([1])
        raise KeyError("boom")
    assert not any(p.name.startswith("failed") for p in tmp_path.iterdir())


def test_bad_input_errors_name_the_problem(tmp_path: Path) -> None:
    writer = IndexedDatasetWriter(tmp_path / "small", np.uint16)
    with pytest.raises(ValueError, match=r"70000.*uint16.*best_dtype"):
        writer.add_document([1, 70000])
    with pytest.raises(ValueError, match="1-D"):
        writer.add_document([[1, 2]])
    writer.abort()
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetWriter(tmp_path / "x", np.float16)
    (tmp_path / "junk.bin").write_bytes(b"")
    (tmp_path / "junk.idx").write_bytes(b"not an index at all, not at all")
    with pytest.raises(ValueError, match="not a Megatron mmap index"):
        IndexedDataset(tmp_path / "junk")
    with IndexedDatasetWriter(tmp_path / "cut", np.uint16) as ok:
        ok.add_document(list(range(10)))
    data = idx_path(tmp_path / "cut").read_bytes()
    idx_path(tmp_path / "cut").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(tmp_path / "cut")
    idx_path(tmp_path / "cut").write_bytes(data)
    bin_path(tmp_path / "cut").write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="inconsistent"):
        IndexedDataset(tmp_path / "cut")


def test_reader_bounds_and_pickling(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "p", np.int32) as writer:
        writer.add_document([9, 8, 7])
        writer.add_document([])
    ds = IndexedDataset(tmp_path / "p")
    assert ds[1].tolist() == [] and ds.document(1).tolist() == []
    with pytest.raises(IndexError, match="out of range"):
        ds[2]
    with pytest.raises(IndexError, match="outside sequence"):
        ds.get(0, 2, 5)
    with pytest.raises(ValueError, match="contiguous"):
        ds[0:2:2]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[0].tolist() == [9, 8, 7] and len(pickle.dumps(ds)) < 200
    assert not ds[0].flags.writeable


def test_range_check_covers_every_integer_pair(tmp_path) -> None:
    """The writer's range check (a cast round trip) agrees with a per-value check at every edge
    of every source/target integer pair."""
    sources = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
    for src in sources:
        s = np.iinfo(src)
        for dst in (np.uint8, np.uint16, np.int8, np.int16, np.int32, np.int64):
            d = np.iinfo(dst)
            bounds = (int(d.min), int(d.max))
            edges = {0, 1, -1, s.min, s.max, *bounds, bounds[0] - 1, bounds[1] + 1}
            for v in sorted(e for e in edges if s.min <= e <= s.max):
                writer = IndexedDatasetWriter(tmp_path / "r", dst)
                doc = np.array([3, v, 0], dtype=src)
                if bounds[0] <= v <= bounds[1]:
                    writer.add_document(doc)
                else:
                    with pytest.raises(ValueError, match="does not fit"):
                        writer.add_document(doc)
                writer.abort()


def test_batched_writes_keep_order_and_ignore_later_mutation(tmp_path) -> None:
    """Converted documents are batched, the caller's own arrays written at once: the file
    holds every document in order, as it was when added."""
    mine = np.array([7, 8, 9], dtype=np.uint16)
    docs = [[1, 2], np.array([3, 4, 5], dtype=np.int64), mine, [6], np.arange(4, dtype=np.int32)]
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
        mine[:] = 0
    ds = IndexedDataset(tmp_path / "b")
    assert [ds[i].tolist() for i in range(len(ds))] == [
        [1, 2],
        [3, 4, 5],
        [7, 8, 9],
        [6],
        [0, 1, 2, 3],
    ]
