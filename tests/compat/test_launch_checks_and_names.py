"""The pre-launch path checks (one line naming the flag), Megatron's --load rules, and LoRA
target names in both spellings mapped onto the fused layers."""

from __future__ import annotations

import pytest

from models import build_model
from models.lora import LoraConfig, apply_lora, resolve_targets
from models.registry import get_config
from services.trainer.arguments import parse_args
from training.launch_checks import check_paths, load_action

MOCK = ["--model", "tiny-llama", "--mock-data", "--train-iters", "2"]


def _one_line_error(argv: list[str]) -> str:
    with pytest.raises(ValueError) as caught:
        check_paths(parse_args(argv))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_paths_and_tokenizers_are_checked_naming_the_flag(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "corpus_text_document.idx").write_bytes(b"")
    (tmp_path / "d" / "corpus_text_document.bin").write_bytes(b"")
    data = ["--model", "tiny-llama", "--tokenizer-type", "SentencePiece", "--tokenizer-model"]
    msg = _one_line_error([*data, str(tmp_path / "no.model"), "--data-path",
                           str(tmp_path / "d" / "corpus_text_document")])  # fmt: skip
    assert "--tokenizer-model" in msg and "no such file" in msg
    (tmp_path / "tok.model").write_bytes(b"x")
    msg = _one_line_error([*data, str(tmp_path / "tok.model"), "--data-path",
                           str(tmp_path / "d" / "corpus")])  # fmt: skip
    assert "--data-path" in msg and "corpus_text_document" in msg  # names what is there
    msg = _one_line_error([*data, str(tmp_path / "tok.model"), "--data-path", "0.5",
                           str(tmp_path / "d" / "corpus_text_document"), "0.5",
                           str(tmp_path / "nodir" / "x")])  # fmt: skip
    assert "--data-path" in msg and "does not exist" in msg
    hf = ["--model", "tiny-llama", "--mock-data", "--tokenizer-type", "PretrainedFromHF",
          "--tokenizer-name-or-path", str(tmp_path / "d")]  # fmt: skip
    assert "holds none of" in _one_line_error(hf)
    msg = _one_line_error([*MOCK, "--lora-load", str(tmp_path / "nope"), "--lora-r", "4"])
    assert "--lora-load" in msg
    (tmp_path / "file").write_text("x")
    assert "--save" in _one_line_error([*MOCK, "--save", str(tmp_path / "file")])


def test_load_follows_megatron(tmp_path):
    ckpt = tmp_path / "ckpt"
    same = [*MOCK, "--load", str(ckpt), "--save", str(ckpt)]
    assert load_action(parse_args(MOCK)) == "none"
    assert load_action(parse_args(same)) == "fresh"  # fresh dir, load = save: start, then resume
    ckpt.mkdir()
    assert load_action(parse_args([*MOCK, "--load", str(ckpt)])) == "fresh"  # empty dir
    (ckpt / "latest").write_text("3")
    assert load_action(parse_args(same)) == "resume"
    typo = parse_args([*MOCK, "--load", str(tmp_path / "ckpt2")])
    with pytest.raises(ValueError, match="does not exist"):
        load_action(typo)
    for extra in (["--finetune"], ["--exit-on-missing-checkpoint"]):
        args = [*MOCK, "--load", str(tmp_path / "empty"), "--save", str(tmp_path / "empty")]
        with pytest.raises(ValueError, match="no checkpoint to resume from"):
            load_action(parse_args([*args, *extra]))


@pytest.mark.parametrize(
    ("targets", "leaves"),
    [
        (["query_key_value", "dense", "gate_proj", "dense_h_to_4h", "dense_4h_to_h"],
         {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
        (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
         {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
        (["W_pack", "dense_4h_to_h"], {"qkv_proj", "down_proj"}),
    ],
)  # fmt: skip
def test_lora_targets_in_both_spellings_select_the_fused_layers(targets, leaves):
    model = build_model(get_config("tiny-llama"))
    names = resolve_targets(model, targets)
    assert {n.rpartition(".")[2] for n in names} == leaves


def test_part_of_a_fused_projection_alone_is_still_refused():
    model = build_model(get_config("tiny-llama"))
    with pytest.raises(ValueError, match="fuses it into qkv_proj"):
        resolve_targets(model, ["q_proj", "v_proj"])


def test_megatron_module_names_to_save():
    model = build_model(get_config("tiny-llama"))
    config = LoraConfig(target_modules=["dense"], modules_to_save=["word_embeddings",
                                                                   "output_layer"])  # fmt: skip
    apply_lora(model, config)
    assert config.modules_to_save == ["embed_tokens", "lm_head"]
    assert model.embed_tokens.weight.requires_grad and model.lm_head.weight.requires_grad
