"""A checkpoint carries the tokenizer it was trained with: a SentencePiece --tokenizer-model, or
the tokenizer files of a local --tokenizer-name-or-path directory (so convert and serve find it)."""

from __future__ import annotations

from training.setup import HF_TOKENIZER_FILES, tokenizer_files


def test_a_sentencepiece_model_file_is_carried(tmp_path):
    model = tmp_path / "sp.model"
    assert tokenizer_files(str(model), None) == [model]


def test_a_local_hf_directory_carries_its_tokenizer_files_only(tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "notes.txt"):
        (directory / name).write_text("{}")
    files = tokenizer_files(None, str(directory))
    assert [p.name for p in files] == ["tokenizer.json", "tokenizer_config.json"]
    assert all(p.name in HF_TOKENIZER_FILES for p in files)


def test_a_hub_name_or_nothing_carries_nothing(tmp_path):
    assert tokenizer_files(None, "org/some-model") == []
    assert tokenizer_files(None, None) == []


def test_a_saved_run_carries_its_hf_tokenizer(tmp_path):
    """Through the trainer: --save writes the HF tokenizer's files under tokenizer/."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>", "a", "b"])}
    rust = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=rust,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(tmp_path / "tok")
    flags = [
        "--model", "tiny-llama", "--mock-data", "--vocab-size", "6", "--seq-length", "8",
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", str(tmp_path / "tok"),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
        "--save", str(tmp_path / "run"),
    ]  # fmt: skip
    Trainer(parse_args(flags)).save()
    saved = tmp_path / "run" / "step-000000" / "tokenizer"
    assert sorted(p.name for p in saved.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((saved / "tokenizer.json").read_text())["model"]["vocab"] == vocab
