"""Meshline encodes as `AutoTokenizer.from_pretrained(dir)` does, for every convention users bring.

Qwen2.5-style BPE (no BOS), Llama-3-style BPE (`<|begin_of_text|>` from the post-processor),
sentencepiece directories with and without `add_bos_token`, and SmolLM2's real GPT-2-style BPE:
`encode(text, add_special_tokens=True)` equals transformers' default `encode`, without special
tokens equals `add_special_tokens=False`, special tokens written in the text included.
"""

from __future__ import annotations

import pytest

from engine.tokens import TokenizerInfo
from models.tokenizer import build_tokenizer
from tests.fixtures.tokenizer_conventions import CONVENTIONS, SAMPLE_TEXTS, build_convention

EXPECTED_PREFIX = {
    "qwen2.5": (),
    "llama3": ("<|begin_of_text|>",),
    "sentencepiece-bos": ("<s>",),
    "sentencepiece-nobos": (),
    "smollm2": (),
}


@pytest.fixture(scope="session", params=[*CONVENTIONS, "smollm2"])
def convention_dir(request, tmp_path_factory):
    """(name, HF tokenizer directory) for each convention."""
    if request.param == "smollm2":
        return request.param, request.getfixturevalue("smollm2_tokenizer_dir")
    directory = tmp_path_factory.mktemp("convention") / request.param
    return request.param, build_convention(request.param, directory)


def test_encoding_equals_auto_tokenizer(convention_dir):
    from transformers import AutoTokenizer

    name, directory = convention_dir
    reference = AutoTokenizer.from_pretrained(str(directory))
    ours = build_tokenizer("PretrainedFromHF", directory)
    assert [reference.convert_ids_to_tokens(i) for i in ours.prefix_ids] == list(
        EXPECTED_PREFIX[name]
    )
    assert ours.suffix_ids == ()
    assert (ours.bos_id, ours.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    tokens = TokenizerInfo.from_tokenizer(ours, ours.vocab_size)
    for text in SAMPLE_TEXTS:
        assert ours.encode(text, add_special_tokens=True) == reference.encode(text), text
        assert tokens.encode_prompt(text) == reference.encode(text), text
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
    texts = list(SAMPLE_TEXTS)
    assert ours.encode_batch(texts, add_special_tokens=True) == [reference.encode(t) for t in texts]
    ids = reference.encode(SAMPLE_TEXTS[0] + " <|im_end|>")
    assert ours.pieces(ids) == reference.convert_ids_to_tokens(ids)


def test_smollm2_prompt_has_no_bos(smollm2_tokenizer_dir):
    """The issue's example: SmolLM2's tokenizer adds no BOS to a text prompt."""
    ours = build_tokenizer("PretrainedFromHF", smollm2_tokenizer_dir)
    tokens = TokenizerInfo.from_tokenizer(ours, ours.vocab_size)
    assert tokens.encode_prompt("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tokens.bos_id == 1 and tokens.prefix_id == 1
    assert tokens.pieces([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_bare_sentencepiece_reads_special_pieces_in_text_as_transformers(tmp_path):
    """A bare `.model` (`--tokenizer-type SentencePiece`): `<s>`, `</s>`, `<pad>`, `<unk>` in text
    are their ids, and the text after one gets no dummy prefix, as transformers' LlamaTokenizer
    built from the same model file encodes them (BOS first with the defaults)."""
    from transformers import AutoTokenizer

    directory = build_convention("sentencepiece-bos", tmp_path / "sp")
    reference = AutoTokenizer.from_pretrained(str(directory))
    ours = build_tokenizer("SentencePiece", directory / "tokenizer.model")
    texts = ["<s>Q: hi", "a <s> b", "x</s>y", "hello<pad>there", "<unk>z", "hello world", "<s>"]
    for text in texts:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == reference.encode(text), text
    assert ours.encode_batch(texts, add_special_tokens=True) == [reference.encode(t) for t in texts]
