"""`run_preprocess` end to end: shards read back by megatron-core equal the tokenizer's ids."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading

import numpy as np
import pytest
import sentencepiece as spm
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

from models.tokenizer import build_tokenizer
from services.preprocess.handlers import IGNORE_INDEX, INSTRUCTION_KEYS, get_handler_class
from services.preprocess.job import PreprocessCancelled, PreprocessConfig, run_preprocess
from services.preprocess.manifest import read_manifest
from tests.fixtures import records as fx
from tokendata.arrow_shards import read_arrow_shards

EOS = 2
BOS = 1
TEXTS = [f"{line} Document {i}." for i, line in enumerate(fx.PLAIN * 4)]


def config(sentencepiece_model, inputs, prefix, **overrides) -> PreprocessConfig:
    return PreprocessConfig(
        input=tuple(str(i) for i in inputs),
        output_prefix=str(prefix),
        tokenizer_type="SentencePiece",
        tokenizer_model=str(sentencepiece_model),
        **overrides,
    )


def megatron_docs(prefix) -> list[list[int]]:
    dataset = MegatronIndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


class _Document:
    """Reference ids of a pretraining document: sentencepiece's own, after BOS (the bare model's
    framing, LlamaTokenizer's default; see models/tokenizer.py)."""

    def __init__(self, sp: spm.SentencePieceProcessor) -> None:
        self.sp = sp

    def encode(self, text: str) -> list[int]:
        return [BOS, *self.sp.encode(text)]


@pytest.fixture(scope="module")
def sp(sentencepiece_model):
    return _Document(spm.SentencePieceProcessor(model_file=str(sentencepiece_model)))


@pytest.mark.parametrize("suffix", ["jsonl", "txt", "csv", "parquet", "jsonl.gz"])
def test_pretrain_shards_read_back_by_megatron(tmp_path, sentencepiece_model, sp, suffix):
    rows = [{"text": t} for t in TEXTS]
    path = tmp_path / f"corpus.{suffix}"
    if suffix == "txt":
        fx.write_txt(path, TEXTS)
    else:
        {
            "jsonl": fx.write_jsonl,
            "jsonl.gz": fx.write_jsonl,
            "csv": fx.write_csv,
            "parquet": fx.write_parquet,
        }[suffix](path, rows)
    result = run_preprocess(
        config(sentencepiece_model, [path], tmp_path / "out" / "corpus", append_eod=True)
    )
    prefix = tmp_path / "out" / "corpus_text_document"
    assert result.outputs[0].path_prefix == str(prefix)
    assert megatron_docs(prefix) == [[*sp.encode(t), EOS] for t in TEXTS]
    assert MegatronIndexedDataset(str(prefix)).index.dtype == np.uint16  # vocab 512 < 65500
    assert result.documents == len(TEXTS)
    assert result.tokens == sum(len(sp.encode(t)) + 1 for t in TEXTS)


def test_several_json_keys_write_one_dataset_each(tmp_path, sentencepiece_model, sp):
    rows = [{"text": t, "title": t[:10]} for t in TEXTS]
    path = fx.write_jsonl(tmp_path / "c.jsonl", rows)
    run_preprocess(config(sentencepiece_model, [path], tmp_path / "c", json_keys=("text", "title")))
    assert megatron_docs(tmp_path / "c_text_document") == [sp.encode(r["text"]) for r in rows]
    assert megatron_docs(tmp_path / "c_title_document") == [sp.encode(r["title"]) for r in rows]


@pytest.mark.parametrize(
    ("handler", "records", "writer"),
    [
        ("GeneralInstructionHandler", fx.ALPACA, fx.write_json_array),
        ("BelleMultiTurnInstructionHandler", fx.BELLE, fx.write_jsonl),
        ("MOSSInstructionHandler", fx.MOSS, fx.write_jsonl),
        ("LeetcodePythonInstructionHandler", fx.LEETCODE, fx.write_jsonl),
        ("SharegptInstructionHandler", fx.SHAREGPT, fx.write_jsonl),
    ],
)
def test_instruction_datasets_read_back_by_megatron(
    tmp_path, sentencepiece_model, handler, records, writer
):
    path = writer(
        tmp_path / ("data.json" if writer is fx.write_json_array else "data.jsonl"), records
    )
    result = run_preprocess(
        config(sentencepiece_model, [path], tmp_path / "sft", handler_name=handler)
    )
    assert [o.json_key for o in result.outputs] == list(INSTRUCTION_KEYS)
    reference = get_handler_class(handler)(build_tokenizer("SentencePiece", sentencepiece_model))
    samples = [reference.process(r) for r in records]
    for key in INSTRUCTION_KEYS:
        assert megatron_docs(tmp_path / f"sft_{key}_document") == [s[key] for s in samples]
    labels = MegatronIndexedDataset(str(tmp_path / "sft_packed_labels_document"))
    assert labels.index.dtype == np.int32
    assert all(
        (labels[i] == IGNORE_INDEX).any() and (labels[i] != IGNORE_INDEX).any()
        for i in range(len(labels))
    )


def test_manifest_describes_inputs_tokenizer_and_outputs(tmp_path, sentencepiece_model):
    path = fx.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS] + [{"oops": 1}])
    result = run_preprocess(
        config(sentencepiece_model, [path], tmp_path / "c", append_eod=True, skip_bad_records=True)
    )
    manifest = read_manifest(result.manifest_path)
    assert result.manifest_path == str(tmp_path / "c.manifest.json")
    assert manifest["inputs"] == [
        {
            "path": str(path.resolve()),
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
    ]
    assert manifest["tokenizer"]["type"] == "SentencePiece"
    assert (
        manifest["tokenizer"]["sha256"]
        == hashlib.sha256(sentencepiece_model.read_bytes()).hexdigest()
    )
    assert manifest["handler"]["name"] == "GeneralPretrainHandler"
    assert manifest["tool"]["name"] == "meshline preprocess" and manifest["tool"]["version"]
    (output,) = manifest["outputs"]
    assert output["json_key"] == "text" and output["dtype"] == "uint16"
    assert output["documents"] == len(TEXTS) and output["tokens"] == result.tokens
    for entry in output["files"]:
        data = (tmp_path / entry["name"]).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert (
        manifest["counts"]["skipped_records"] == 1
        and manifest["counts"]["records"] == len(TEXTS) + 1
    )
    assert manifest["bad_records"] == [
        {
            "location": f"{path}:{len(TEXTS) + 1}",
            "error": "missing key 'text'; keys present: ['oops']",
        }
    ]
    assert manifest["config"]["append_eod"] is True


def test_bad_records_fail_fast_naming_file_and_line(tmp_path, sentencepiece_model):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "cut off\n{"text": "fine"}\n')
    with pytest.raises(ValueError) as info:
        run_preprocess(config(sentencepiece_model, [path], tmp_path / "c"))
    assert str(info.value).startswith(f"{path}:2: malformed JSON")
    assert "--skip-bad-records" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_skip_bad_records_counts_and_respects_the_limit(tmp_path, sentencepiece_model, sp):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a b"}\nnot json\n{"body": "x"}\n{"text": "c d"}\n')
    result = run_preprocess(
        config(sentencepiece_model, [path], tmp_path / "ok", skip_bad_records=True)
    )
    assert result.skipped_records == 2 and result.documents == 2
    assert megatron_docs(tmp_path / "ok_text_document") == [sp.encode("a b"), sp.encode("c d")]
    with pytest.raises(
        ValueError, match=r"--max-bad-records 1: more malformed records than allowed"
    ):
        run_preprocess(
            config(
                sentencepiece_model,
                [path],
                tmp_path / "lim",
                skip_bad_records=True,
                max_bad_records=1,
            )
        )
    assert not list(tmp_path.glob("lim*")) and not list(tmp_path.glob(".lim*"))


def test_cancel_publishes_nothing(tmp_path, sentencepiece_model):
    path = fx.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS * 20])
    cancel = threading.Event()
    seen = []

    def on_progress(progress):
        seen.append(progress.documents)
        cancel.set()

    with pytest.raises(PreprocessCancelled):
        run_preprocess(
            config(sentencepiece_model, [path], tmp_path / "out" / "c", chunk_size=8),
            on_progress=on_progress,
            cancel=cancel,
        )
    assert seen and seen[0] > 0
    assert list((tmp_path / "out").iterdir()) == []


def test_failure_mid_run_leaves_no_final_files(tmp_path, sentencepiece_model, monkeypatch):
    (tmp_path / "boom_handler.py").write_text(
        "from services.preprocess.handlers import GeneralPretrainHandler\n"
        "class Boom(GeneralPretrainHandler):\n"
        "    def process_batch(self, records):\n"
        "        if any(r.get('text') == 'boom' for r in records):\n"
        "            raise RuntimeError('disk on fire')\n"
        "        return super().process_batch(records)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"text": t} for t in TEXTS * 4] + [{"text": "boom"}]
    path = fx.write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk on fire"):
        run_preprocess(
            config(
                sentencepiece_model,
                [path],
                out / "c",
                handler_name="boom_handler:Boom",
                chunk_size=4,
            )
        )
    assert list(out.iterdir()) == []


def test_existing_outputs_need_overwrite(tmp_path, sentencepiece_model, sp):
    first = fx.write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}])
    second = fx.write_jsonl(tmp_path / "b.jsonl", [{"text": "two"}, {"text": "three"}])
    run_preprocess(config(sentencepiece_model, [first], tmp_path / "c"))
    with pytest.raises(ValueError, match=r"outputs already exist .* pass --overwrite"):
        run_preprocess(config(sentencepiece_model, [second], tmp_path / "c"))
    run_preprocess(config(sentencepiece_model, [second], tmp_path / "c", overwrite=True))
    assert megatron_docs(tmp_path / "c_text_document") == [sp.encode("two"), sp.encode("three")]


def test_pack_groups_whole_samples_up_to_seq_length(tmp_path, sentencepiece_model):
    records = fx.ALPACA * 6
    path = fx.write_jsonl(tmp_path / "a.jsonl", records)
    run_preprocess(config(sentencepiece_model, [path], tmp_path / "flat", handler_name="alpaca"))
    run_preprocess(
        config(
            sentencepiece_model,
            [path],
            tmp_path / "pk",
            handler_name="alpaca",
            seq_length=400,
            pack=True,
        )
    )
    flat = MegatronIndexedDataset(str(tmp_path / "flat_packed_input_ids_document"))
    packed = MegatronIndexedDataset(str(tmp_path / "pk_packed_input_ids_document"))
    assert packed.sequence_lengths.tolist() == flat.sequence_lengths.tolist()
    assert [packed[i].tolist() for i in range(len(packed))] == [
        flat[i].tolist() for i in range(len(flat))
    ]
    bounds = packed.document_indices.tolist()
    assert len(bounds) - 1 < len(flat)
    for start, end in itertools.pairwise(bounds):
        total = int(packed.sequence_lengths[start:end].sum())
        assert total <= 400 or end - start == 1
    assert int(packed.sequence_lengths[:2].sum()) <= 400 < int(packed.sequence_lengths[:3].sum())


def test_arrow_output_matches_mmap(tmp_path, sentencepiece_model):
    path = fx.write_jsonl(tmp_path / "b.jsonl", fx.BELLE * 3)
    run_preprocess(config(sentencepiece_model, [path], tmp_path / "m", handler_name="belle"))
    result = run_preprocess(
        config(
            sentencepiece_model, [path], tmp_path / "a", handler_name="belle", output_format="arrow"
        )
    )
    (shard,) = result.outputs
    assert shard.files == [str(tmp_path / "a_packed-00000.arrow")]
    table = read_arrow_shards(shard.files).to_pydict()
    assert table["input_ids"] == megatron_docs(tmp_path / "m_packed_input_ids_document")
    assert table["labels"] == megatron_docs(tmp_path / "m_packed_labels_document")
    assert table["loss_mask"] == [[int(x != IGNORE_INDEX) for x in row] for row in table["labels"]]
    assert table["cu_seqlens"] == [[0, len(row)] for row in table["input_ids"]]
    import pyarrow as pa

    with pa.memory_map(shard.files[0], "r") as source:
        meta = json.loads(pa.ipc.open_file(source).schema.metadata[b"meshline"])
    assert meta["handler"]["name"] == "BelleMultiTurnInstructionHandler"


def test_arrow_shards_split_by_size(tmp_path):
    from services.preprocess.arrow_sink import ArrowSink

    sink = ArrowSink(tmp_path / "p", ("text",), {"k": 1}, shard_bytes=4000, batch_rows=8)
    docs = [np.arange(i, i + 50, dtype=np.int32) for i in range(100)]
    for doc in docs:
        sink.add({"text": doc}, {"text": [doc.size]})
    (shard,) = sink.finalize()
    assert len(shard.files) > 2 and shard.documents == 100
    rows = (
        read_arrow_shards([tmp_path / name for name in shard.files]).column("input_ids").to_pylist()
    )
    assert rows == [d.tolist() for d in docs]


def test_overwrite_spares_sibling_prefixes_and_drops_stale_outputs(
    tmp_path, sentencepiece_model, sp
):
    data = fx.write_jsonl(tmp_path / "a.jsonl", [{"text": "one", "title": "t"}])
    run_preprocess(config(sentencepiece_model, [data], tmp_path / "c_v2"))
    run_preprocess(config(sentencepiece_model, [data], tmp_path / "c", json_keys=("text", "title")))
    # c_v2_text_document.* starts with "c_" but belongs to another run: neither a clash nor deleted.
    run_preprocess(config(sentencepiece_model, [data], tmp_path / "c", overwrite=True))
    assert megatron_docs(tmp_path / "c_v2_text_document") == [sp.encode("one")]
    assert not (tmp_path / "c_title_document.bin").exists()  # listed in the replaced manifest
    assert megatron_docs(tmp_path / "c_text_document") == [sp.encode("one")]


def test_hf_fast_tokenizer_shards_match_autotokenizer(tmp_path, hf_tokenizer_dir):
    from transformers import AutoTokenizer

    path = fx.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    run_preprocess(
        PreprocessConfig(
            input=(str(path),),
            output_prefix=str(tmp_path / "hf"),
            tokenizer_type="PretrainedFromHF",
            tokenizer_name_or_path=str(hf_tokenizer_dir),
            append_eod=True,
        )
    )
    reference = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    want = [
        reference(t, add_special_tokens=False)["input_ids"] + [reference.eos_token_id]
        for t in TEXTS
    ]
    assert megatron_docs(tmp_path / "hf_text_document") == want
