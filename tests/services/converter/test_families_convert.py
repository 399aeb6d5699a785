"""Issue #18 families through `meshline convert`: HF → native → HF and HF → Megatron TP2×PP2 → HF
give identical tensors and identical transformers logits (each hop verified by default), the
export keeps llama3 RoPE and the token ids, loads with AutoTokenizer and stops at EOS under HF
`generate`. A trainer checkpoint whose tokenizer is `tok.model` (Qwen2, Bloom, ALiBi Baichuan)
exports as `tokenizer.model` with tokenizer and generation configs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import build_model
from models.registry import get_config
from services.converter.job import ConvertOptions, convert
from tests.models.test_families import FAMILIES, hf_model
from training.checkpoint import CheckpointManager, TrainState


def _tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _free_token(hf, ids):
    """A token the model emits mid-sequence under greedy decoding (to serve as EOS)."""
    with torch.no_grad():
        free = hf.generate(
            ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return int(free[0, ids.shape[1] + 5])


@pytest.fixture(scope="module", params=list(FAMILIES))
def source(request, tmp_path_factory, sentencepiece_model):
    """An HF checkpoint written by transformers, with a tokenizer and an EOS the model emits."""
    hf = hf_model(FAMILIES[request.param], seed=2)
    ids = torch.randint(4, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    eos = _free_token(hf, ids)
    for holder in (hf.config, hf.generation_config):
        holder.bos_token_id, holder.eos_token_id, holder.pad_token_id = 1, eos, 0
    directory = tmp_path_factory.mktemp("src") / request.param
    hf.save_pretrained(directory)
    shutil.copy2(sentencepiece_model, directory / "tokenizer.model")
    return request.param, directory, ids, eos


def _same_model(a, b, ids):
    start, end = _tensors(a), _tensors(b)
    assert sorted(start) == sorted(end)
    for name in start:
        assert torch.equal(start[name], end[name]), name
    with torch.no_grad():
        first = AutoModelForCausalLM.from_pretrained(a).eval()(ids).logits
        second = AutoModelForCausalLM.from_pretrained(b).eval()(ids).logits
    assert torch.equal(first, second)


def test_hf_native_hf_is_identical_and_loads_unchanged(source, tmp_path):
    name, src, ids, eos = source
    convert(ConvertOptions("hf", "native", src, tmp_path / "native"))
    report = convert(ConvertOptions("native", "hf", tmp_path / "native", tmp_path / "hf"))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0.0
    out = tmp_path / "hf"
    _same_model(src, out, ids)
    before = json.loads((src / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters"):
        assert after.get(key) == before.get(key), key
    if name == "llama3":
        assert after["rope_parameters"]["rope_type"] == "llama3"
    # The export loads unchanged: tokenizer and generate stopping at the EOS of config.json.
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world").input_ids[0] == tokenizer.bos_token_id == 1
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        generated = hf.generate(ids, max_new_tokens=10, do_sample=False)
    new = generated[0, ids.shape[1] :].tolist()
    assert eos in new and new.index(eos) == len(new) - 1  # stopped right at EOS


def test_hf_megatron_tp2_pp2_hf_is_identical(source, tmp_path):
    _, src, ids, _ = source
    convert(ConvertOptions("hf", "megatron", src, tmp_path / "mg", target_tp=2, target_pp=2))
    convert(ConvertOptions("megatron", "hf", tmp_path / "mg", tmp_path / "hf"))
    _same_model(src, tmp_path / "hf", ids)
    assert (tmp_path / "hf" / "tokenizer.model").is_file()


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-bloom", "tiny-baichuan-alibi"])
def test_trainer_checkpoint_with_tok_model_exports_for_autotokenizer(
    name, tmp_path, sentencepiece_model
):
    config = get_config(name)
    model = build_model(config, device="cpu")
    model.init_weights(seed=1)
    tok = tmp_path / "tok.model"
    shutil.copy2(sentencepiece_model, tok)
    CheckpointManager(tmp_path / "run", model_config=config.to_dict(), tokenizer_files=[tok]).save(
        2, TrainState(model, save_rng=False)
    )
    report = convert(ConvertOptions("native", "hf", tmp_path / "run", tmp_path / "hf"))
    out = tmp_path / "hf"
    assert "tokenizer.model" in report.files and "tok.model" not in report.files
    written = json.loads((out / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, 2, 3)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 3)
    if config.family == "baichuan":
        # No transformers class (its remote code is not shipped): config.json names the
        # architecture and states the ALiBi choice; Meshline's own reader loads it back.
        assert written["architectures"] == ["BaichuanForCausalLM"]
        assert written["position_embedding"] == "alibi"
        return
    assert AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == 2
