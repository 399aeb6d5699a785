"""GPT sample indices: which tokens make up pretraining sample i (Megatron's GPTDataset scheme).

Three arrays describe an epoch-repeated, shuffled token stream:

- document index `[E * N]`: the split's sequences repeated for E epochs, shuffled by the seed;
- sample index `[num_samples + 1, 2]`: row j is (position in the document index, token offset)
  where sample j starts; sample j is the `seq_length + 1` tokens from row j up to and including
  the token at row j + 1 (consecutive samples share one token: the last label is the next input);
- shuffle index `[num_samples]`: the order samples are served in.

The arithmetic and the RNG call sequence follow megatron-core, so the same seed gives the same
stream as a Megatron run over the same `.bin/.idx` (tests compare the arrays).
"""

from __future__ import annotations

import numpy as np

# Megatron's threshold: a last epoch that would contribute fewer samples than this fraction of an
# epoch is shuffled on its own, so the few samples it gives are not mixed into the earlier epochs.
_FINAL_EPOCH_FRACTION = 0.80


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Epochs needed so `num_samples` samples of `seq_length + 1` tokens fit (1 when None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`documents` repeated `num_epochs` times and shuffled (the last epoch apart if asked)."""
    if separate_final_epoch and num_epochs > 1:
        head = build_document_index(documents, num_epochs - 1, rng, False)
        tail = build_document_index(documents, 1, rng, False)
        return np.concatenate((head, tail))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray, seq_length: int, tokens_total: int
) -> np.ndarray:
    """Start (document-index position, offset) of every sample over the flattened stream.

    Sample j starts at stream token j * seq_length; the last full sample must still own its
    extra label token, hence `(tokens_total - 1) // seq_length` samples.
    """
    num_samples = (tokens_total - 1) // seq_length
    lengths = sizes[document_index].astype(np.int64)
    starts = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: a position belongs to the non-empty one holding it.
    slot = np.searchsorted(starts, positions, side="right") - 1
    offset = positions - starts[slot]
    index_dtype = (
        np.int32 if max(document_index.size, int(sizes.max(initial=0))) < 2**31 else np.int64
    )
    sample_index = np.stack((slot, offset), axis=1).astype(index_dtype)
    sample_index[0] = 0  # Megatron records the stream start as (0, 0) even before empty documents
    return sample_index


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of `[0, num_samples)` followed by a separate one of `[num_samples, total)`."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(num_samples, dtype=dtype)
    rng.shuffle(head)
    if num_samples == total:
        return head
    tail = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


def build_gpt_indices(
    sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) for the given split of sequences.

    `sizes` holds the token count of every sequence in the shard and `documents` the sequence
    ids this split owns; at least `num_samples` samples are indexed (one epoch when None).
    """
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= 1:
        raise ValueError(
            f"this split holds {len(documents)} sequences with {tokens_per_epoch} tokens; a sample "
            f"needs at least 2 (seq_length={seq_length}); give the split more data (--split) or "
            "tokenise a larger corpus"
        )
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if num_epochs > 1:
        assert num_samples is not None
        before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        from_final = num_samples - before_final
        separate_final_epoch = from_final < int(_FINAL_EPOCH_FRACTION * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(
        sizes, document_index, seq_length, num_epochs * tokens_per_epoch
    )
    total = sample_index.shape[0] - 1
    if separate_final_epoch:
        shuffle_index = build_shuffle_index(before_final, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    return document_index, sample_index, shuffle_index
