"""Instruction rows from ModelLink's packed_* datasets (mmap and Arrow), packing, variable lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from tokendata.datasets import DataConfig, build_datasets, collate, first_fit
from tokendata.datasets.packing import packing_efficiency
from tokendata.indexed import IndexedDatasetWriter

PAIRS = [
    ("What is the capital of France?", "Paris."),
    ("Add two and three.", "Five."),
    ("Name a colour of the sky.", "Blue, on a clear day."),
    ("Translate 'chat' from French.", "Cat."),
    ("Give a word that rhymes with tree.", "Bee."),
    ("Say nothing.", "Fine."),
    ("Write a very long answer about rivers and lakes and oceans.", "Water " * 30),
    ("Count to three.", "One, two, three."),
]
SEQ = 48


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory):
    """A real sentencepiece tokenizer trained on the prompts and answers."""
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("spm")
    (root / "corpus.txt").write_text("\n".join(f"{p} {r}" for p, r in PAIRS * 10) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"),
        model_prefix=str(root / "sp"),
        vocab_size=160,
        model_type="bpe",
        pad_id=3,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(root / "sp.model"))


def _examples(sp) -> list[tuple[list[int], list[int]]]:
    """(input ids, unshifted labels) per example: no loss on the prompt, as the handlers write."""
    out = []
    for prompt, response in PAIRS:
        p, r = sp.encode(prompt), [*sp.encode(response), sp.eos_id()]
        out.append((p + r, [-100] * len(p) + r))
    return out


def _write_mmap(prefix: Path, examples, label_dtype=np.int32, lengths=None) -> None:
    keys = {
        "packed_input_ids": np.uint16,
        "packed_attention_mask": np.uint16,
        "packed_labels": label_dtype,
    }
    writers = {k: IndexedDatasetWriter(f"{prefix}_{k}_document", dt) for k, dt in keys.items()}
    groups = lengths or [[len(ids)] for ids, _ in examples]
    it = iter(examples)
    for group in groups:
        batch = [next(it) for _ in group]
        ids = [t for e in batch for t in e[0]]
        labels = [t for e in batch for t in e[1]]
        if np.dtype(label_dtype).kind == "u":
            labels = [t % (np.iinfo(label_dtype).max + 1) for t in labels]
        writers["packed_input_ids"].add_document(ids, lengths=group)
        writers["packed_attention_mask"].add_document([1] * len(ids), lengths=group)
        writers["packed_labels"].add_document(labels, lengths=group)
    for w in writers.values():
        w.finalize()


def _write_arrow(prefix: Path, examples, rows_per_shard: int = 3) -> None:
    ints = pa.list_(pa.int32())
    schema = pa.schema(
        [
            ("input_ids", ints),
            ("cu_seqlens", ints),
            ("labels", ints),
            ("loss_mask", pa.list_(pa.uint8())),
        ]
    )
    for shard, start in enumerate(range(0, len(examples), rows_per_shard)):
        chunk = examples[start : start + rows_per_shard]
        columns = {
            "input_ids": [ids for ids, _ in chunk],
            "cu_seqlens": [[0, len(ids)] for ids, _ in chunk],
            "labels": [labels for _, labels in chunk],
            "loss_mask": [[int(x != -100) for x in labels] for _, labels in chunk],
        }
        path = f"{prefix}_packed-{shard:05d}.arrow"
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_table(pa.table(columns, schema=schema))


def _build(prefix: Path, tmp_path: Path, sp, **flags):
    config = DataConfig(
        data_path=[str(prefix)],
        split="1,0,0",
        is_instruction_dataset=True,
        cache_dir=str(tmp_path / "cache"),
        **flags,
    )
    return build_datasets(
        config, {"eod_id": sp.eos_id(), "pad_id": sp.pad_id()}, SEQ, 1234, (None, 0, 0)
    )[0]


def _by_first_tokens(dataset) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    return {tuple(dataset[i]["input_ids"][:6].tolist()): dataset[i] for i in range(len(dataset))}


def test_labels_are_shifted_and_mask_the_prompt(tmp_path: Path, sp) -> None:
    examples = _examples(sp)
    _write_mmap(tmp_path / "sft", examples)
    dataset = _build(tmp_path / "sft", tmp_path, sp)
    assert len(dataset) == len(examples)
    rows = _by_first_tokens(dataset)
    for (_prompt, response), (ids, labels) in zip(PAIRS, examples, strict=True):
        sample = rows[tuple(ids[:6])]
        assert all(v.shape == (SEQ,) for v in sample.values())
        n = min(len(ids), SEQ)
        assert sample["input_ids"][:n].tolist() == ids[:n]
        assert sample["input_ids"][n:].eq(sp.pad_id()).all()
        expected = [*labels[1:n], -100] + [-100] * (SEQ - n)
        assert sample["labels"].tolist() == expected
        assert torch.equal(sample["loss_mask"], (sample["labels"] != -100).float())
        if len(ids) <= SEQ:
            trained = [t for t in sample["labels"].tolist() if t != -100]
            assert sp.decode(trained) == response.strip()
        assert "segment_ids" not in sample


def test_arrow_shards_give_the_same_rows(tmp_path: Path, sp) -> None:
    examples = _examples(sp)
    _write_mmap(tmp_path / "m", examples)
    _write_arrow(tmp_path / "a", examples)
    assert len(list(tmp_path.glob("a_packed-*.arrow"))) == 3
    from_mmap, from_arrow = (
        _build(tmp_path / "m", tmp_path, sp),
        _build(tmp_path / "a", tmp_path, sp),
    )
    for i in range(len(from_mmap)):
        for key in from_mmap[i]:
            assert torch.equal(from_mmap[i][key], from_arrow[i][key]), key


def test_unsigned_label_shards_keep_ignore_index(tmp_path: Path, sp) -> None:
    examples = _examples(sp)
    _write_mmap(tmp_path / "s", examples)
    _write_mmap(tmp_path / "u", examples, label_dtype=np.uint16)
    signed, wrapped = _build(tmp_path / "s", tmp_path, sp), _build(tmp_path / "u", tmp_path, sp)
    for i in range(len(signed)):
        assert torch.equal(signed[i]["labels"], wrapped[i]["labels"])


def test_packing_first_fit_with_positions_and_segments(tmp_path: Path, sp) -> None:
    examples = _examples(sp)
    _write_mmap(tmp_path / "p", examples)
    packed = _build(tmp_path / "p", tmp_path, sp, pack=True)
    plain = _by_first_tokens(_build(tmp_path / "p", tmp_path, sp))
    lengths = [min(len(ids), SEQ) for ids, _ in examples]
    assert len(packed) == len(first_fit(np.array(lengths), SEQ)) < len(examples)
    seen = 0
    for i in range(len(packed)):
        row = packed[i]
        segments = row["segment_ids"]
        for seg in segments.unique().tolist():
            where = (segments == seg).nonzero().flatten()
            assert torch.equal(row["position_ids"][where], torch.arange(where.numel()))
            if seg == 0:  # padding
                assert row["labels"][where].eq(-100).all()
                continue
            seen += 1
            ids = row["input_ids"][where]
            alone = plain[tuple(ids[:6].tolist())]
            assert torch.equal(ids, alone["input_ids"][: ids.numel()])
            assert torch.equal(row["labels"][where], alone["labels"][: ids.numel()])
    assert seen == len(examples)


def test_prepacked_documents_are_read_per_sample(tmp_path: Path, sp) -> None:
    examples = _examples(sp)
    _write_mmap(
        tmp_path / "pre",
        examples,
        lengths=[[len(e[0]) for e in examples[:3]], *[[len(e[0])] for e in examples[3:]]],
    )
    dataset = _build(tmp_path / "pre", tmp_path, sp)
    assert len(dataset) == len(examples)


def test_variable_seq_lengths_pad_to_the_longest(tmp_path: Path, sp) -> None:
    examples = _examples(sp)
    _write_mmap(tmp_path / "v", examples)
    dataset = _build(tmp_path / "v", tmp_path, sp, variable_seq_lengths=True)
    samples = [dataset[i] for i in range(3)]
    lengths = [s["input_ids"].numel() for s in samples]
    assert sorted(lengths) == sorted(
        min(len(e[0]), SEQ) for e in [examples[int(dataset.order[i])] for i in range(3)]
    )
    batch = collate(samples, variable_seq_lengths=True, pad_id=sp.pad_id())
    assert batch["input_ids"].shape == (3, max(lengths))
    for row, n in enumerate(lengths):
        assert batch["labels"][row, n:].eq(-100).all() and batch["loss_mask"][row, n:].eq(0).all()
        assert batch["input_ids"][row, n:].eq(sp.pad_id()).all()
        assert torch.equal(batch["input_ids"][row, :n], samples[row]["input_ids"])
    rounded = collate(samples, variable_seq_lengths=True, pad_id=0, pad_to_multiple_of=8)
    assert rounded["input_ids"].shape[1] % 8 == 0
    with pytest.raises(ValueError, match="variable-seq-lengths"):
        collate(samples, variable_seq_lengths=False)


def test_num_samples_repeats_epochs_deterministically(tmp_path: Path, sp) -> None:
    _write_mmap(tmp_path / "e", _examples(sp))
    config = DataConfig(
        data_path=[str(tmp_path / "e")],
        split="1,0,0",
        is_instruction_dataset=True,
        cache_dir=str(tmp_path / "c"),
    )
    info = {"eod_id": sp.eos_id(), "pad_id": sp.pad_id()}
    train = build_datasets(config, info, SEQ, 7, (20, 0, 0))[0]
    assert len(train) == 20
    order = train.order.tolist()
    assert sorted(order[:8]) == list(range(8)) and sorted(order[8:16]) == list(range(8))
    again = build_datasets(config, info, SEQ, 7, (20, 0, 0))[0]
    assert again.order.tolist() == order


def test_first_fit_places_each_item_in_the_first_bin_with_room() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 64, size=300)
    for decreasing in (False, True):
        bins = first_fit(lengths, 64, decreasing=decreasing)
        order = np.argsort(-lengths, kind="stable") if decreasing else np.arange(lengths.size)
        free: list[int] = []
        expected: list[list[int]] = []
        for item in order.tolist():
            slot = next((b for b, room in enumerate(free) if room >= lengths[item]), len(free))
            if slot == len(free):
                free.append(64)
                expected.append([])
            free[slot] -= int(lengths[item])
            expected[slot].append(item)
        assert bins == expected
    assert packing_efficiency(lengths, first_fit(lengths, 64), 64) > 0.9
    with pytest.raises(ValueError, match="exceeds"):
        first_fit(np.array([65]), 64)


def test_missing_or_mismatched_data_errors(tmp_path: Path, sp) -> None:
    with pytest.raises(FileNotFoundError, match="no dataset found"):
        _build(tmp_path / "nothing", tmp_path, sp)
    examples = _examples(sp)
    _write_mmap(tmp_path / "x", examples)
    with IndexedDatasetWriter(tmp_path / "x_packed_labels_document", np.int32) as w:
        w.add_document([1, 2, 3])
    with pytest.raises(ValueError, match="disagree"):
        _build(tmp_path / "x", tmp_path, sp)
    with pytest.raises(ValueError, match="--pack needs --is-instruction-dataset"):
        DataConfig(data_path=["x"], pack=True)
