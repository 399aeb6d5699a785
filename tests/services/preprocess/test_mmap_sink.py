"""`MmapSink` buffers documents and writes them in batches: the shards are byte-identical to one
`add_document` per document, whatever the batch size, packed or not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.preprocess.handlers import INSTRUCTION_KEYS
from services.preprocess.outputs import MmapSink, Packer, dataset_dtype
from tokendata.indexed import IndexedDatasetWriter, bin_path, idx_path


def _samples(rng: np.random.Generator, count: int) -> list[dict[str, np.ndarray]]:
    samples = []
    for _ in range(count):
        size = int(rng.integers(1, 40))
        ids = rng.integers(0, 30000, size=size).astype(np.int32)
        labels = np.where(rng.random(size) < 0.3, -100, ids).astype(np.int32)
        samples.append({"packed_input_ids": ids, "packed_attention_mask": ids * 0 + 1,
                        "packed_labels": labels})  # fmt: skip
    return samples


@pytest.mark.parametrize("batch_tokens", [1, 50, 1 << 20])
@pytest.mark.parametrize("seq_length", [None, 64])
def test_sink_batches_write_the_per_document_bytes(
    tmp_path: Path, batch_tokens: int, seq_length: int | None
) -> None:
    keys = tuple(INSTRUCTION_KEYS)
    samples = _samples(np.random.default_rng(batch_tokens), 300)
    sink = MmapSink(tmp_path / "stage" / "run", keys, vocab_size=32000, batch_tokens=batch_tokens)
    writers = {
        key: IndexedDatasetWriter(
            tmp_path / "ref" / f"run_{key}_document", dataset_dtype(key, 32000)
        )
        for key in keys
    }
    packer = Packer(seq_length)
    documents = [doc for sample in samples for doc in packer.add(sample)] + packer.flush()
    for arrays, lengths in documents:
        sink.add(arrays, lengths)
        for key, writer in writers.items():
            writer.add_document(arrays[key], lengths=lengths[key])
    shards = sink.finalize()
    for writer in writers.values():
        writer.finalize()
    assert [shard.json_key for shard in shards] == list(keys)
    for shard in shards:
        ours = tmp_path / "stage" / shard.path_prefix
        ref = tmp_path / "ref" / shard.path_prefix
        assert bin_path(ours).read_bytes() == bin_path(ref).read_bytes()
        assert idx_path(ours).read_bytes() == idx_path(ref).read_bytes()
        assert shard.documents == len(documents)
        assert shard.tokens == sum(len(arrays[shard.json_key]) for arrays, _ in documents)


def test_sink_abort_leaves_nothing(tmp_path: Path) -> None:
    sink = MmapSink(tmp_path / "run", ("text",), vocab_size=32000, batch_tokens=1 << 20)
    sink.add({"text": np.array([1, 2, 3], dtype=np.int32)}, {"text": [3]})
    sink.abort()
    assert list(tmp_path.iterdir()) == []
