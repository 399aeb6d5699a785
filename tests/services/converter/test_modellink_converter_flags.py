"""The converter's Megatron/ModelLink flags that used to be accepted without effect:
`--lora-target-modules` is checked against the adapter, `--tokenizer-model` against the model
and the source's own tokenizer (and carried into an output whose source has none)."""

from __future__ import annotations

import shutil

import pytest

from services.converter.cli import build_parser, options_from_args
from services.converter.job import ConvertOptions, convert
from tests.fixtures.tokenizers import build_sentencepiece
from tests.services.converter.test_lora import _adapter


def _bloom(directory, vocab: int, tokenizer=None):
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=1, n_head=4))
    model.save_pretrained(directory)
    if tokenizer is not None:
        shutil.copy2(tokenizer, directory / "tokenizer.model")
    return directory


def _named(path, directory):
    """`path` copied as `directory/tokenizer.model` (the name Megatron's loader reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    return shutil.copy2(path, directory / "tokenizer.model")


def test_lora_target_modules_must_cover_the_adapter(llama_dir, tmp_path):
    _adapter(llama_dir, tmp_path / "adapter", "llama")  # q/k/v/o and gate/up/down
    options = dict(lora_dir=tmp_path / "adapter", verify=False)
    with pytest.raises(ValueError, match=r"also adapts \['down_proj', 'gate_proj', 'up_proj'\]"):
        convert(ConvertOptions("hf", "hf", llama_dir, tmp_path / "a", **options,
                               lora_target_modules=("query_key_value", "dense")))  # fmt: skip
    assert not (tmp_path / "a").exists()
    # ModelLink's Megatron spellings of the same modules pass.
    targets = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
    convert(ConvertOptions("hf", "hf", llama_dir, tmp_path / "b", **options,
                           lora_target_modules=targets))  # fmt: skip
    assert (tmp_path / "b" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="give it with --lora-load"):
        options_from_args(build_parser().parse_args(
            ["--load", "x", "--save", "y", "--lora-target-modules", "dense"]))  # fmt: skip


def test_tokenizer_model_is_checked_and_carried(sentencepiece_model, tmp_path):
    sp512 = _named(sentencepiece_model, tmp_path / "sp512")  # the 512-piece fixture
    bare = _bloom(tmp_path / "bare", 600)
    out = tmp_path / "carried"
    convert(ConvertOptions("hf", "hf", bare, out, tokenizer_model=sp512, verify=False))
    assert (out / "tokenizer.model").read_bytes() == sp512.read_bytes()
    small = _bloom(tmp_path / "small", 400)
    with pytest.raises(ValueError, match="512 tokens do not fit the model's 400-row embedding"):
        convert(ConvertOptions("hf", "hf", small, tmp_path / "x", tokenizer_model=sp512))
    own = _bloom(tmp_path / "own", 600, tokenizer=sentencepiece_model)
    convert(ConvertOptions("hf", "hf", own, tmp_path / "same", tokenizer_model=sp512))
    other = _named(build_sentencepiece(tmp_path / "sp450", vocab_size=450), tmp_path / "sp450")
    with pytest.raises(ValueError, match="carries its own tokenizer"):
        convert(ConvertOptions("hf", "hf", own, tmp_path / "y", tokenizer_model=other))
    with pytest.raises(ValueError, match=r"named tokenizer\.model"):
        convert(ConvertOptions("hf", "hf", bare, tmp_path / "z",
                               tokenizer_model=sentencepiece_model))  # fmt: skip
    assert not any((tmp_path / name).exists() for name in "xyz")
