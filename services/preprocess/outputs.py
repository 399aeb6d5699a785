"""Output sinks shared by the pipeline: the result record, sample packing, Megatron mmap shards.

A sink receives documents in order, each a dict of int32 arrays (one per output key) plus, per
key, the lengths of the samples it holds (one sample unless `--pack`), writes under a staging
prefix, and on `finalize` returns an `OutputShard` per dataset with file names relative to the
staging directory; `job.py` publishes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from services.preprocess.handlers import INSTRUCTION_KEYS, PAIRWISE_KEYS
from tokendata.indexed import IndexedDatasetWriter, best_dtype
from tokendata.token_batches import BATCH_TOKENS

PAIRWISE_LABEL_KEYS = tuple(key for key in PAIRWISE_KEYS if key.endswith("_labels"))


@dataclass
class OutputShard:
    """One written dataset (mirrors meshline.preprocess.v1.OutputShard)."""

    json_key: str
    """Output key: a --json-keys entry or packed_input_ids / packed_attention_mask / packed_labels."""
    path_prefix: str
    """Prefix to pass as --data-path (no suffix)."""
    files: list[str] = field(default_factory=list)
    """Files of the dataset (final paths once published)."""
    documents: int = 0
    """Documents written."""
    tokens: int = 0
    """Tokens written."""


class Sink(Protocol):
    """Where documents go."""

    def add(self, arrays: dict[str, np.ndarray], lengths: dict[str, list[int]]) -> None:
        """Append one document holding samples of `lengths[key]` tokens per key."""

    def finalize(self) -> list[OutputShard]:
        """Close the files; returns the datasets written (paths relative to the staging dir)."""

    def abort(self) -> None:
        """Discard everything written."""


Document = tuple[dict[str, np.ndarray], dict[str, list[int]]]


class Packer:
    """Greedy in-order packing of whole samples into documents of at most `seq_length` tokens.

    A sample longer than `seq_length` becomes a document of its own (instruction samples are
    already truncated by the handler). Without packing every sample is its own document. The
    first output key's length decides (instruction keys are aligned; for several pretraining
    keys the first one sets the pack boundaries).
    """

    def __init__(self, seq_length: int | None) -> None:
        self.seq_length = seq_length
        self._parts: list[dict[str, np.ndarray]] = []
        self._size = 0

    def add(self, arrays: dict[str, np.ndarray]) -> list[Document]:
        """Take one sample; returns the documents completed by it (zero or one)."""
        size = len(next(iter(arrays.values())))
        if self.seq_length is None:
            return [(arrays, {key: [len(value)] for key, value in arrays.items()})]
        done = []
        if self._parts and self._size + size > self.seq_length:
            done.append(self.flush_one())
        self._parts.append(arrays)
        self._size += size
        return done

    def flush_one(self) -> Document:
        """The current pack as one document."""
        parts, self._parts, self._size = self._parts, [], 0
        keys = parts[0].keys()
        merged = {key: np.concatenate([part[key] for part in parts]) for key in keys}
        return merged, {key: [len(part[key]) for part in parts] for key in keys}

    def flush(self) -> list[Document]:
        """The last, partly filled pack (if any)."""
        return [self.flush_one()] if self._parts else []


def dataset_dtype(key: str, vocab_size: int) -> np.dtype:
    """Megatron's dtype for token ids (by vocabulary size); int32 for labels, which hold -100."""
    if key == INSTRUCTION_KEYS[2] or key in PAIRWISE_LABEL_KEYS:
        return np.dtype(np.int32)
    return best_dtype(vocab_size)


class MmapSink:
    """Megatron `.bin/.idx` per output key, named `{prefix}_{key}_document`.

    A packed document stores its samples as separate sequences (Megatron's document/sequence
    split), so `document_indices` give the packs and `sequence_lengths` the samples in them.
    Documents are buffered and handed to the writers in batches of about `BATCH_TOKENS` tokens
    (`IndexedDatasetWriter.add_documents`: one conversion, range check and write per batch
    instead of per document); the files are the same as with one `add_document` per document.
    """

    def __init__(
        self,
        stage_prefix: Path,
        keys: tuple[str, ...],
        vocab_size: int,
        batch_tokens: int = BATCH_TOKENS,
    ) -> None:
        self.stage_dir = stage_prefix.parent
        self.keys = keys
        self.batch_tokens = batch_tokens
        self._writers = {
            key: IndexedDatasetWriter(
                f"{stage_prefix}_{key}_document", dataset_dtype(key, vocab_size)
            )
            for key in keys
        }
        self._documents: dict[str, list[np.ndarray]] = {key: [] for key in keys}
        self._lengths: dict[str, list[list[int]]] = {key: [] for key in keys}
        self._buffered = 0

    def add(self, arrays: dict[str, np.ndarray], lengths: dict[str, list[int]]) -> None:
        """Append one document to every key's dataset (buffered; written in batches)."""
        for key in self.keys:
            self._documents[key].append(arrays[key])
            self._lengths[key].append(lengths[key])
        self._buffered += len(arrays[self.keys[0]])
        if self._buffered >= self.batch_tokens:
            self._flush()

    def _flush(self) -> None:
        for key, writer in self._writers.items():
            documents, lengths = self._documents[key], self._lengths[key]
            if documents:
                self._documents[key], self._lengths[key] = [], []
                writer.add_documents(documents, lengths)
        self._buffered = 0

    def finalize(self) -> list[OutputShard]:
        """Finish every `.bin/.idx` pair."""
        self._flush()
        shards = []
        for key, writer in self._writers.items():
            bin_file, idx_file = writer.finalize()
            shards.append(
                OutputShard(
                    json_key=key,
                    path_prefix=Path(writer.path_prefix).name,
                    files=[bin_file.name, idx_file.name],
                    documents=writer.num_documents,
                    tokens=writer.num_tokens,
                )
            )
        return shards

    def abort(self) -> None:
        """Remove partial files."""
        self._documents = {key: [] for key in self.keys}
        self._lengths = {key: [] for key in self.keys}
        for writer in self._writers.values():
            writer.abort()
