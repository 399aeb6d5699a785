"""Pairwise (preference) handlers: exact ids and labels per layout, shared prompt, errors, shards."""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

from models.tokenizer import build_tokenizer
from services.preprocess.handlers import (
    IGNORE_INDEX,
    PAIRWISE_KEYS,
    HandlerOptions,
    RecordError,
    get_handler_class,
)
from services.preprocess.job import PreprocessConfig, run_preprocess
from services.preprocess.manifest import read_manifest
from tests.fixtures import records as fx
from tokendata.arrow_shards import read_arrow_shards
from tokendata.datasets.pairwise import PairSource, PairwiseDataset

EOS = 2
BOS = 1
"""The bare SentencePiece model frames a text as LlamaTokenizer does: BOS first, no EOS."""
HH_PROMPT = "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Tell me a joke."
HH_CHOSEN = " Why did the chicken cross the road? To get to the other side."
HH_REJECTED = " No."


@pytest.fixture(scope="module")
def tok(sentencepiece_model):
    return build_tokenizer("SentencePiece", sentencepiece_model)


@pytest.fixture(scope="module")
def sp(sentencepiece_model):
    return spm.SentencePieceProcessor(model_file=str(sentencepiece_model))


def handler(tok, name, **options):
    return get_handler_class(name)(tok, HandlerOptions(**options))


def expected_side(sp, prompt_parts, reply):
    """(ids, labels): the tokenizer's BOS and the prompt parts (text, eos after) carry no loss;
    the reply and its EOS do."""
    ids = [BOS]
    for text, eos in prompt_parts:
        ids += sp.encode(text) + ([EOS] if eos else [])
    reply_ids = [*sp.encode(reply), EOS]
    return ids + reply_ids, [IGNORE_INDEX] * len(ids) + reply_ids


def check(sample, sp, prompt_parts, chosen, rejected):
    for side, reply in (("chosen", chosen), ("rejected", rejected)):
        ids, labels = expected_side(sp, prompt_parts, reply)
        assert sample[f"{side}_input_ids"] == ids, side
        assert sample[f"{side}_labels"] == labels, side


CHATML_PROMPT = [
    ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", False)
]


def test_trl_conversational_explicit_prompt_applies_the_chat_template(tok, sp):
    record = {
        "prompt": [{"role": "user", "content": "What is the capital of France?"}],
        "chosen": [{"role": "assistant", "content": "Paris."}],
        "rejected": [{"role": "assistant", "content": "Lyon, I think."}],
    }
    sample = handler(tok, "preference").process(record)
    check(sample, sp, CHATML_PROMPT, "Paris.<|im_end|>\n", "Lyon, I think.<|im_end|>\n")


def test_trl_conversational_implicit_prompt_splits_at_the_last_assistant_turn(tok, sp):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    record = {
        "chosen": [*question, {"role": "assistant", "content": "Paris."}],
        "rejected": [*question, {"role": "assistant", "content": "Lyon, I think."}],
    }
    sample = handler(tok, "PreferencePairwiseHandler").process(record)
    check(sample, sp, CHATML_PROMPT, "Paris.<|im_end|>\n", "Lyon, I think.<|im_end|>\n")


def test_trl_plain_text_is_used_as_written(tok, sp):
    explicit = {"prompt": "The sky is", "chosen": " blue today.", "rejected": " green today."}
    sample = handler(tok, "preference").process(explicit)
    check(sample, sp, [("The sky is", False)], " blue today.", " green today.")
    implicit = {"chosen": "The sky is blue today.", "rejected": "The sky is green today."}
    sample = handler(tok, "preference").process(implicit)
    check(sample, sp, [("The sky is ", False)], "blue today.", "green today.")


def test_each_side_is_the_sft_sample_of_the_same_conversation(tok):
    """One tokenisation path: a side's ids are what instruction data of that dialogue stores."""
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    record = {"prompt": conversation, "chosen": "A short one.", "rejected": "No."}
    pair = handler(tok, "preference").process(record)
    for side in ("chosen", "rejected"):
        messages = [*conversation, {"role": "assistant", "content": record[side]}]
        sft = handler(tok, "sharegpt").process({"messages": messages})
        assert pair[f"{side}_input_ids"] == sft["packed_input_ids"]
        reply = [i for i, label in enumerate(pair[f"{side}_labels"]) if label != IGNORE_INDEX]
        # Only the final reply carries loss; the earlier assistant turn is context here.
        assert sft["packed_labels"][reply[0] :] == pair[f"{side}_labels"][reply[0] :]
        assert sum(label != IGNORE_INDEX for label in sft["packed_labels"][: reply[0]]) > 0
    prompt_len = pair["chosen_labels"].index(next(x for x in pair["chosen_labels"] if x != -100))
    assert pair["chosen_input_ids"][:prompt_len] == pair["rejected_input_ids"][:prompt_len]


HH_PARTS = [
    ("\n\nHuman: Hi there\n\nAssistant: ", False),
    ("Hello! How can I help?", True),
    ("\n\nHuman: Tell me a joke.\n\nAssistant: ", False),
]


def test_anthropic_hh_dialogues_share_the_prompt_up_to_the_last_assistant_turn(tok, sp):
    record = {
        "chosen": HH_PROMPT + "\n\nAssistant:" + HH_CHOSEN,
        "rejected": HH_PROMPT + "\n\nAssistant:" + HH_REJECTED,
    }
    sample = handler(tok, "hh").process(record)
    check(sample, sp, HH_PARTS, HH_CHOSEN[1:], HH_REJECTED[1:])
    assert handler(tok, "HHRLHFPairwiseHandler").describe()["pairwise"] is True


def test_rm_static_layout_equals_the_hh_dialogue(tok):
    hh = {
        "chosen": HH_PROMPT + "\n\nAssistant:" + HH_CHOSEN,
        "rejected": HH_PROMPT + "\n\nAssistant:" + HH_REJECTED,
    }
    static = {
        "prompt": HH_PROMPT + "\n\nAssistant:",
        "response": HH_CHOSEN,
        "chosen": HH_CHOSEN,
        "rejected": HH_REJECTED,
    }
    assert handler(tok, "rm-static").process(static) == handler(tok, "hh").process(hh)


def test_alpaca_style_pairs_in_both_spellings(tok, sp):
    record = {"instruction": "Name a colour.", "input": "", "chosen": "Red.", "rejected": "Cat."}
    sample = handler(tok, "AlpacaStylePairwiseHandler").process(record)
    prompt = [
        (
            "Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.\n\n",
            False,
        ),
        ("### Instruction:\nName a colour.\n\n### Response:\n", False),
    ]
    check(sample, sp, prompt, "Red.", "Cat.")
    listed = {"instruction": "Name a colour.", "output": ["Red.", "Cat."]}
    assert handler(tok, "alpaca_pairwise").process(listed) == sample


def test_sharegpt_style_pairs(tok, sp):
    record = {
        "conversations": [{"from": "human", "value": "What is the capital of France?"}],
        "chosen": {"from": "gpt", "value": "Paris."},
        "rejected": {"from": "gpt", "value": "Lyon, I think."},
    }
    sample = handler(tok, "SharegptStylePairwiseHandler").process(record)
    check(sample, sp, CHATML_PROMPT, "Paris.<|im_end|>\n", "Lyon, I think.<|im_end|>\n")
    assert handler(tok, "sharegpt_pairwise").process(record) == sample


@pytest.mark.parametrize(
    ("name", "record", "message"),
    [
        ("preference", {"prompt": "Q", "chosen": "A"}, "missing key 'rejected'"),
        (
            "preference",
            {"prompt": "Q", "chosen": "  ", "rejected": "B"},
            "chosen response is empty",
        ),
        ("preference", {"prompt": "Q", "chosen": "A", "rejected": "A"}, "the same response"),
        ("preference", {"chosen": "Red.", "rejected": "Blue."}, "share none"),
        (
            "hh",
            {"chosen": "\n\nHuman: A\n\nAssistant: x", "rejected": "\n\nHuman: B\n\nAssistant: y"},
            "must share the prompt",
        ),
        ("hh", {"chosen": "no turns", "rejected": "\n\nHuman: B"}, "is not an HH dialogue"),
        ("rm-static", {"prompt": "\n\nHuman: A", "chosen": "x", "rejected": "y"}, "empty"),
        ("alpaca_pairwise", {"instruction": "Q", "output": ["only one"]}, "\\[chosen, rejected\\]"),
        (
            "sharegpt_pairwise",
            {"conversations": [{"from": "human", "value": "Q"}], "chosen": "A", "rejected": 3},
            "'rejected' must be a string",
        ),
    ],
)
def test_bad_pairs_are_refused_saying_what_is_wrong(tok, name, record, message):
    with pytest.raises(RecordError, match=message):
        handler(tok, name).process(record)


def test_seq_length_leaving_no_response_is_refused(tok):
    record = {"prompt": "A long question " * 20, "chosen": "Yes.", "rejected": "No."}
    with pytest.raises(RecordError, match="leaves no room for the chosen response"):
        handler(tok, "preference", seq_length=8).process(record)
    shared = {"prompt": "Q?", "chosen": "Same start then yes.", "rejected": "Same start then no."}
    with pytest.raises(RecordError, match="same within --seq-length"):
        handler(tok, "preference", seq_length=5).process(shared)


PAIRS = [
    {"prompt": "What is the capital of France?", "chosen": " Paris.", "rejected": " Lyon."},
    {"prompt": "Name a colour.", "chosen": " Red.", "rejected": " A cat, probably."},
    {"prompt": "Two plus two?", "chosen": " Four.", "rejected": " Five."},
]


def _config(sentencepiece_model, path, prefix, **overrides):
    return PreprocessConfig(
        input=(str(path),),
        output_prefix=str(prefix),
        tokenizer_type="SentencePiece",
        tokenizer_model=str(sentencepiece_model),
        handler_name="preference",
        **overrides,
    )


def test_pairwise_shards_mmap_and_arrow_hold_the_same_pairs(tmp_path, sentencepiece_model, tok):
    path = fx.write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    result = run_preprocess(_config(sentencepiece_model, path, tmp_path / "m"))
    assert [shard.json_key for shard in result.outputs] == list(PAIRWISE_KEYS)
    samples = [handler(tok, "preference").process(record) for record in PAIRS]
    for key in PAIRWISE_KEYS:
        dataset = MegatronIndexedDataset(str(tmp_path / f"m_{key}_document"))
        assert [dataset[i].tolist() for i in range(len(dataset))] == [s[key] for s in samples]
    manifest = read_manifest(tmp_path / "m.manifest.json")
    assert manifest["handler"]["pairwise"] is True
    assert {o["json_key"]: o["dtype"] for o in manifest["outputs"]}["chosen_labels"] == "int32"

    arrow = run_preprocess(
        _config(sentencepiece_model, path, tmp_path / "a", output_format="arrow")
    )
    (shard,) = arrow.outputs
    assert shard.files == [str(tmp_path / "a_pairs-00000.arrow")]
    table = read_arrow_shards(shard.files)
    rows = table.to_pydict()
    for key in PAIRWISE_KEYS:
        assert rows[key] == [s[key] for s in samples]
    for side in ("chosen", "rejected"):
        masks = [[int(x != IGNORE_INDEX) for x in row] for row in rows[f"{side}_labels"]]
        assert rows[f"{side}_loss_mask"] == masks
    meta = json.loads(table.schema.metadata[b"meshline"])
    assert meta["handler"]["pairwise"] is True
    # The training side reads either format into the same padded pairs.
    from_mmap, from_arrow = PairSource(str(tmp_path / "m")), PairSource(str(tmp_path / "a"))
    assert len(from_mmap) == len(from_arrow) == len(PAIRS)
    for i, sample in enumerate(samples):
        for key in PAIRWISE_KEYS:
            assert (
                from_mmap.pair(i)[key].tolist() == from_arrow.pair(i)[key].tolist() == sample[key]
            )
    pad = tok.pad_id
    (padded,) = PairwiseDataset(from_arrow, (1, 2), 40, pad, None, seed=0)
    n = len(samples[1]["chosen_input_ids"])
    assert padded["chosen_input_ids"][:n].tolist() == samples[1]["chosen_input_ids"]
    assert padded["chosen_input_ids"][n:].eq(pad).all()
    assert padded["chosen_attention_mask"].sum() == n
    assert padded["chosen_loss_mask"].tolist() == [
        float(x != IGNORE_INDEX) for x in samples[1]["chosen_labels"]
    ] + [0.0] * (40 - n)
    with pytest.raises(
        ValueError, match=r"pair 1 has a chosen side of \d+ tokens, longer than --seq-length 4"
    ):
        PairwiseDataset(from_mmap, (1, 2), 4, pad, None, seed=0)[0]


def test_bad_pair_names_the_record_and_pack_is_refused(tmp_path, sentencepiece_model):
    path = fx.write_jsonl(
        tmp_path / "bad.jsonl", [PAIRS[0], {"prompt": "Q", "chosen": "A", "rejected": "A"}]
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: chosen and rejected are the same"):
        run_preprocess(_config(sentencepiece_model, path, tmp_path / "x"))
    with pytest.raises(ValueError, match="--pack with --handler-name preference"):
        run_preprocess(_config(sentencepiece_model, path, tmp_path / "y", pack=True, seq_length=64))
