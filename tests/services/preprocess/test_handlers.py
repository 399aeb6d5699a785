"""Prompt handlers: exact token ids and loss masks per format, errors, the registry."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
import sentencepiece as spm

from models.tokenizer import build_tokenizer
from services.preprocess.handlers import (
    IGNORE_INDEX,
    HandlerOptions,
    RecordError,
    get_handler_class,
    handler_choices,
)
from tests.fixtures import records as fx

EOS = 2
BOS = 1
"""The bare SentencePiece model frames a text as LlamaTokenizer does: BOS first, no EOS."""


@pytest.fixture(scope="module")
def tok(sentencepiece_model):
    return build_tokenizer("SentencePiece", sentencepiece_model)


@pytest.fixture(scope="module")
def sp(sentencepiece_model):
    return spm.SentencePieceProcessor(model_file=str(sentencepiece_model))


def expected(sp, parts):
    """input_ids / labels from (text, loss, eos_after) parts, tokenised by the reference library,
    after the tokenizer's BOS (no loss on it)."""
    ids, labels = [BOS], [IGNORE_INDEX]
    for text, loss, eos in parts:
        piece = sp.encode(text) + ([EOS] if eos else [])
        ids += piece
        labels += piece if loss else [IGNORE_INDEX] * len(piece)
    return ids, labels


def check(sample, ids, labels):
    assert sample["packed_input_ids"] == ids
    assert sample["packed_labels"] == labels
    assert sample["packed_attention_mask"] == [1] * len(ids)


def test_alpaca_masks_the_prompt(tok, sp):
    handler = get_handler_class("GeneralInstructionHandler")(tok)
    with_input, without_input = fx.ALPACA[1], fx.ALPACA[0]
    ids, labels = expected(
        sp,
        [
            (
                "Below is an instruction that describes a task, paired with an input that provides "
                "further context. Write a response that appropriately completes the request.\n\n",
                False,
                False,
            ),
            (
                "### Instruction:\nTranslate to French.\n\n### Input:\nhello\n\n### Response:\n",
                False,
                False,
            ),
            ("Bonjour.", True, True),
        ],
    )
    check(handler.process(with_input), ids, labels)
    sample = handler.process(without_input)
    assert sample["packed_labels"][-len(sp.encode("Eat well, exercise, sleep.")) - 1 :] == (
        [*sp.encode("Eat well, exercise, sleep."), EOS]
    )
    assert set(sample["packed_labels"][: -len(sp.encode("Eat well, exercise, sleep.")) - 1]) == {
        IGNORE_INDEX
    }


def test_belle_trains_only_assistant_turns(tok, sp):
    handler = get_handler_class("belle")(tok)
    ids, labels = expected(
        sp,
        [
            ("Human: What is the capital of France?\n\nAssistant: ", False, False),
            ("Paris.", True, True),
            ("\n\n", False, False),
            ("Human: And of Italy?\n\nAssistant: ", False, False),
            ("Rome.", True, True),
        ],
    )
    check(handler.process(fx.BELLE[0]), ids, labels)


def test_moss_trains_thoughts_commands_and_replies(tok, sp):
    handler = get_handler_class("MOSSInstructionHandler")(tok)
    turn1, turn2 = fx.MOSS[0]["chat"]["turn_1"], fx.MOSS[0]["chat"]["turn_2"]
    ids, labels = expected(
        sp,
        [
            (fx.MOSS[0]["meta_instruction"], False, False),
            (turn1["Human"], False, False),
            (turn1["Inner Thoughts"], True, False),
            (turn1["Commands"], True, False),
            (turn1["Tool Responses"], False, False),
            (turn1["MOSS"], True, False),
            (turn2["Human"], False, False),
            (turn2["MOSS"], True, False),
        ],
    )
    check(handler.process(fx.MOSS[0]), [*ids, EOS], [*labels, EOS])


def test_leetcode_and_sharegpt(tok, sp):
    leetcode = get_handler_class("leetcode")(tok).process(fx.LEETCODE[0])
    ids, labels = expected(
        sp,
        [
            (
                "Below is a programming problem. Write a Python solution that solves it.\n\n",
                False,
                False,
            ),
            (f"### Problem:\n{fx.LEETCODE[0]['content']}\n\n### Python solution:\n", False, False),
            (fx.LEETCODE[0]["python"], True, True),
        ],
    )
    check(leetcode, ids, labels)
    sharegpt = get_handler_class("SharegptInstructionHandler")(tok)
    ids, labels = expected(
        sp,
        [
            ("<|im_start|>system\nYou are helpful.<|im_end|>\n", False, False),
            (
                "<|im_start|>user\nHow do I reverse a list in Python?<|im_end|>\n<|im_start|>assistant\n",
                False,
                False,
            ),
            ("Use items[::-1].<|im_end|>\n", True, True),
        ],
    )
    check(sharegpt.process(fx.SHAREGPT[0]), ids, labels)
    assert sharegpt.process(fx.SHAREGPT[1])["packed_labels"][-1] == EOS


def test_seq_length_truncates_instruction_samples(tok):
    handler = get_handler_class("alpaca")(tok, HandlerOptions(seq_length=16))
    sample = handler.process(fx.ALPACA[0])
    assert all(len(v) == 16 for v in sample.values())


def test_pretrain_handler_keys_and_eod(tok, sp):
    handler = get_handler_class("GeneralPretrainHandler")(
        tok, HandlerOptions(json_keys=("text", "title"), append_eod=True)
    )
    results = handler.process_batch(
        [{"text": "hello world", "title": "T"}, {"text": "x"}, {"text": "", "title": ""}]
    )
    assert results[0] == {
        "text": [BOS, *sp.encode("hello world"), EOS],
        "title": [BOS, *sp.encode("T"), EOS],
    }
    assert isinstance(results[1], RecordError)
    assert str(results[1]) == "missing key 'title'; keys present: ['text']"
    assert results[2] == {"text": [BOS, EOS], "title": [BOS, EOS]}
    plain = get_handler_class("pretrain")(tok)
    assert plain.process({"text": ""}) is None


@pytest.mark.parametrize(
    ("name", "record", "message"),
    [
        ("alpaca", {"instruction": "x"}, "missing key 'output'; keys present: ['instruction']"),
        ("alpaca", {"instruction": 3, "output": "y"}, "field 'instruction' must be a string"),
        ("belle", {"text": "x"}, "missing key 'conversations'"),
        ("belle", {"conversations": [{"from": "alien", "value": "x"}]}, "unknown role 'alien'"),
        ("belle", {"conversations": [{"from": "human", "value": "x"}]}, "no assistant turn"),
        ("moss", {"chat": {"round1": {}}}, "must be turn_<n>"),
        ("leetcode", {"content": "p"}, "missing key one of"),
    ],
)
def test_bad_records_raise_record_error(tok, name, record, message):
    with pytest.raises(RecordError, match=re.escape(message)):
        get_handler_class(name)(tok).process(record)


def test_registry_and_user_handler(tok, tmp_path, monkeypatch):
    assert "GeneralInstructionHandler" in handler_choices() and "alpaca" in handler_choices()
    with pytest.raises(ValueError, match="--handler-name 'Nope' is unknown"):
        get_handler_class("Nope")
    with pytest.raises(ValueError, match="cannot import module"):
        get_handler_class("no_such_module_xyz:Handler")
    (tmp_path / "my_handlers.py").write_text(
        textwrap.dedent(
            """
            from services.preprocess.handlers import Handler

            class Upper(Handler):
                name = "Upper"

                def process(self, record):
                    return {"text": self.tokenizer.encode(record["text"].upper())}

            class NotAHandler:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    upper = get_handler_class("my_handlers:Upper")(tok)
    assert upper.process({"text": "abc"}) == {"text": tok.encode("ABC")}
    with pytest.raises(ValueError, match="no Handler subclass 'NotAHandler'"):
        get_handler_class("my_handlers:NotAHandler")
    sys.modules.pop("my_handlers", None)
