"""Preprocess shards hold the HF tokenizer's own ids plus the documented EOS, per convention.

Pretraining documents are `AutoTokenizer.from_pretrained(dir).encode(text)` (BOS only where the
tokenizer adds it) followed by EOS with `--append-eod`; instruction samples start with what the
tokenizer puts before a text, then each segment's ids without special tokens, each reply
followed by EOS (see docs/preprocess.md).
"""

from __future__ import annotations

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from models.templates import Message
from models.tokenizer import build_tokenizer
from services.preprocess.handlers import IGNORE_INDEX, get_handler_class
from services.preprocess.job import PreprocessConfig, run_preprocess
from tests.fixtures import records as fx
from tests.fixtures.tokenizer_conventions import CONVENTIONS, SAMPLE_TEXTS, build_convention

DOCUMENTS = [t for t in SAMPLE_TEXTS if t.strip()]


@pytest.fixture(scope="module", params=[*CONVENTIONS, "smollm2"])
def tokenizer_dir(request, tmp_path_factory):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_tokenizer_dir")
    return build_convention(request.param, tmp_path_factory.mktemp("tok") / request.param)


def test_pretrain_documents_are_the_hf_ids_plus_eod(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    path = fx.write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in DOCUMENTS])
    for append_eod in (True, False):
        prefix = tmp_path / f"out_{append_eod}"
        run_preprocess(
            PreprocessConfig(
                input=(str(path),),
                output_prefix=str(prefix),
                tokenizer_name_or_path=str(tokenizer_dir),
                append_eod=append_eod,
            )
        )
        dataset = IndexedDataset(str(prefix) + "_text_document")
        eod = [reference.eos_token_id] if append_eod else []
        assert [dataset[i].tolist() for i in range(len(dataset))] == [
            [*reference.encode(t), *eod] for t in DOCUMENTS
        ]


def test_instruction_sample_is_framed_as_the_hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    handler = get_handler_class("GeneralInstructionHandler")(
        build_tokenizer("PretrainedFromHF", tokenizer_dir)
    )
    record = fx.ALPACA[1]
    template = handler.template
    segments = template.render(
        [
            Message("user", template.user_content(record["instruction"], record["input"])),
            Message("assistant", record["output"]),
        ],
        has_input=True,
    )
    ids = reference.encode(segments[0].text)  # the first segment with the tokenizer's framing
    labels = [IGNORE_INDEX] * len(ids)
    for segment in segments[1:]:
        piece = reference.encode(segment.text, add_special_tokens=False)
        if segment.loss:
            piece = [*piece, reference.eos_token_id]
        ids += piece
        labels += piece if segment.loss else [IGNORE_INDEX] * len(piece)
    sample = handler.process(record)
    assert sample["packed_input_ids"] == ids
    assert sample["packed_labels"] == labels
