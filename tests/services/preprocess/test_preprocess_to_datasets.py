"""Shards from `run_preprocess` are served by the trainer's datasets (mmap and Arrow alike)."""

from __future__ import annotations

import pytest

from models.tokenizer import build_tokenizer
from services.preprocess.handlers import IGNORE_INDEX, get_handler_class
from services.preprocess.job import PreprocessConfig, run_preprocess
from tests.fixtures import records as fx
from tokendata.datasets import build_datasets
from tokendata.datasets.config import DataConfig

SEQ = 256


@pytest.mark.parametrize("output_format", ["mmap", "arrow"])
def test_instruction_shards_serve_prompt_masked_samples(
    tmp_path, sentencepiece_model, output_format
):
    data = fx.write_jsonl(tmp_path / "belle.jsonl", fx.BELLE)
    prefix = tmp_path / "belle"
    run_preprocess(
        PreprocessConfig(
            input=(str(data),),
            output_prefix=str(prefix),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(sentencepiece_model),
            handler_name="belle",
            output_format=output_format,
        )
    )
    tok = build_tokenizer("SentencePiece", sentencepiece_model)
    expected = [get_handler_class("belle")(tok).process(r) for r in fx.BELLE]
    config = DataConfig(data_path=[str(prefix)], is_instruction_dataset=True, split="1,0,0")
    train, _, _ = build_datasets(config, tok, SEQ, seed=1234)
    served = [train[i] for i in range(len(train))]
    assert len(served) == len(expected)
    by_first_ids = {tuple(s["packed_input_ids"]): s for s in expected}
    for sample in served:
        ids = sample["input_ids"].tolist()
        match = next(e for key, e in by_first_ids.items() if ids[: len(key)] == list(key))
        trained = [t for t in sample["labels"].tolist() if t != IGNORE_INDEX]
        assert trained == [t for t in match["packed_labels"] if t != IGNORE_INDEX]
        assert int(sample["loss_mask"].sum()) == len(trained)


def test_pretraining_shards_serve_fixed_length_samples(tmp_path, sentencepiece_model):
    texts = [f"{line} number {i}" for i, line in enumerate(fx.PLAIN * 20)]
    data = fx.write_txt(tmp_path / "c.txt", texts)
    prefix = tmp_path / "c"
    result = run_preprocess(
        PreprocessConfig(
            input=(str(data),),
            output_prefix=str(prefix),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(sentencepiece_model),
            append_eod=True,
        )
    )
    tok = build_tokenizer("SentencePiece", sentencepiece_model)
    config = DataConfig(data_path=[result.outputs[0].path_prefix], split="1,0,0")
    train, _, _ = build_datasets(config, tok, 32, seed=7)
    docs = [tok.encode(text, add_special_tokens=True) for text in texts]

    def inside_a_document(piece: list[int]) -> bool:
        n = len(piece)
        return any(doc[i : i + n] == piece for doc in docs for i in range(len(doc) - n + 1))

    windows = [train[index]["input_ids"].tolist() for index in range(min(len(train), 12))]
    assert any(tok.eod_id in window for window in windows)
    for window in windows:
        assert len(window) == 32
        pieces, current = [], []
        for token in window:
            if token == tok.eod_id:
                pieces.append(current)
                current = []
            else:
                current.append(token)
        pieces.append(current)
        # Documents are shuffled, but every EOD-free run must be a contiguous part of one document.
        assert all(inside_a_document(piece) for piece in pieces if piece)
