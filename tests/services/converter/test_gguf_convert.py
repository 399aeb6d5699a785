"""`meshline convert --load-format gguf` / `--save-format gguf` end to end.

- SmolLM2-135M-Instruct's real Q4_1 file converted to native and run through Meshline's engine
  gives the same greedy tokens as transformers `generate` on the same file (dequantized by
  transformers' GGUF loader), on chat-templated prompts tokenized by the converted tokenizer.
- Meshline → GGUF → Meshline is exact for F32/F16/BF16 and for Q8_0 after the first
  quantization; the written files load in transformers' GGUF loader (which follows llama.cpp's
  conventions, Q/K permutation included) with the same weights and tokenizer.
- Models and flags GGUF cannot hold are refused before anything is read or written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from checkpoints.gguf_format import GGUFSource
from checkpoints.hf_format import HFSource
from checkpoints.units import units
from models.hf_adapters import to_hf
from services.converter.job import ConvertOptions, convert
from tests.checkpoints.test_gguf import smollm2_gguf
from tests.services.converter.conftest import _randomise, hf_bloom, hf_llama_gqa

ROOT = Path(__file__).resolve().parents[3]
CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def _state(source) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for unit in units(source.config):
        state.update(source.read_unit(unit))
    return state


@pytest.fixture(scope="module")
def llama_bpe(tmp_path_factory) -> Path:
    """A tiny HF Llama (GQA) with a byte-level BPE tokenizer and a chat template."""
    from models.tokenizer import train_bpe_tokenizer

    directory = tmp_path_factory.mktemp("src") / "llama"
    config = LlamaConfig(
        vocab_size=320,  # a byte-level BPE has 256 byte tokens + specials + merges
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    _randomise(LlamaForCausalLM(config), seed=3).save_pretrained(directory)
    texts = ["hello world, the quick brown fox jumps over the lazy dog"] * 20
    train_bpe_tokenizer(texts, directory, vocab_size=300)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT
    config_path.write_text(json.dumps(config))
    return directory


def _convert(load_format, save_format, load, save, **kw):
    return convert(ConvertOptions(load_format, save_format, load, save, **kw))


@pytest.mark.parametrize(("dtype", "kind"), [("fp32", "F32"), ("fp16", "F16"), ("bf16", "BF16")])
def test_float_types_round_trip_exactly(llama_bpe, tmp_path, dtype, kind):
    from gguf import GGUFReader

    _convert("hf", "gguf", llama_bpe, tmp_path / "g", dtype=dtype)
    types = {t.name: t.tensor_type.name for t in GGUFReader(tmp_path / "g" / "model.gguf").tensors}
    assert types["blk.0.attn_q.weight"] == kind and types["blk.0.attn_norm.weight"] == "F32"
    _convert("gguf", "hf", tmp_path / "g" / "model.gguf", tmp_path / "back", dtype=dtype)
    source, back = _state(HFSource(llama_bpe)), _state(HFSource(tmp_path / "back"))
    assert set(source) == set(back)
    for name, tensor in source.items():
        assert torch.equal(back[name], tensor.to(back[name].dtype)), name
        assert back[name].dtype == {"fp32": torch.float32, "fp16": torch.float16,
                                    "bf16": torch.bfloat16}[dtype]  # fmt: skip


def test_q8_0_round_trip_is_exact_after_the_first_quantization(llama_bpe, tmp_path):
    _convert("hf", "gguf", llama_bpe, tmp_path / "g1", gguf_type="Q8_0")
    _convert("gguf", "native", tmp_path / "g1", tmp_path / "n1")
    _convert("native", "gguf", tmp_path / "n1", tmp_path / "g2", gguf_type="Q8_0")
    _convert("gguf", "native", tmp_path / "g2", tmp_path / "n2")
    first = _state(GGUFSource(tmp_path / "g1"))
    second = _state(GGUFSource(tmp_path / "g2"))
    source = _state(HFSource(llama_bpe))
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
        if tensor.dim() == 2:  # quantized: close to the source, not equal
            scale = source[name].abs().max()
            assert 0 < (tensor - source[name]).abs().max() <= scale / 127, name
    a = (tmp_path / "g1" / "model.gguf").read_bytes()
    assert a == (tmp_path / "g2" / "model.gguf").read_bytes()


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_0"])
def test_written_files_load_in_transformers_gguf_loader(llama_bpe, tmp_path, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _convert("hf", "gguf", llama_bpe, tmp_path / "g", gguf_type=kind)
    ours = to_hf(_state(GGUFSource(tmp_path / "g")), GGUFSource(tmp_path / "g").config)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="model.gguf")
    reference = model.state_dict()
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(reference[name].float(), tensor), name
    source = _state(HFSource(llama_bpe))
    q = to_hf(source, HFSource(llama_bpe).config)["model.layers.0.self_attn.q_proj.weight"]
    tolerance = {"F16": 1e-3, "Q8_0": 0.02, "Q4_0": 0.2}[kind] * q.abs().max()
    assert (reference["model.layers.0.self_attn.q_proj.weight"] - q).abs().max() < tolerance
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "g", gguf_file="model.gguf")
    original = AutoTokenizer.from_pretrained(llama_bpe)
    for text in ("hello world", "the lazy dog, quickly!", " fox  jumps"):
        assert tokenizer(text).input_ids == original(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(
        chat, tokenize=False
    )


def test_models_gguf_cannot_hold_are_refused_before_anything_is_written(tmp_path):
    bloom = tmp_path / "bloom"
    hf_bloom(num_layers=1).save_pretrained(bloom)
    with pytest.raises(ValueError, match="family 'bloom'"):
        _convert("hf", "gguf", bloom, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    plain = tmp_path / "plain"
    hf_llama_gqa(num_layers=1).save_pretrained(plain)
    with pytest.raises(ValueError, match="needs the source's tokenizer"):
        _convert("hf", "gguf", plain, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="--gguf-type 'Q8_0' needs --save-format gguf"):
        ConvertOptions("hf", "native", plain, tmp_path / "out", gguf_type="Q8_0")
    with pytest.raises(ValueError, match="one of"):
        ConvertOptions("hf", "gguf", plain, tmp_path / "out", gguf_type="Q4_K")


def test_cli_refuses_an_unsupported_type_before_writing(tmp_path):
    from tests.checkpoints.test_gguf import write_llama_gguf

    path = write_llama_gguf(tmp_path / "k.gguf", types=("Q4_K", "Q5_0"))
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "convert", "--load-format", "gguf", "--save-format", "hf",
         "--load-dir", str(path), "--save-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "ggml type Q5_0" in result.stderr and "Q4_K, Q5_K, Q6_K" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_smollm2_from_gguf_generates_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.engine import Engine
    from engine.loading import load_checkpoint
    from engine.sampling import SamplingConfig
    from engine.tokens import TokenizerInfo

    path = smollm2_gguf()
    report = _convert("gguf", "native", path, tmp_path / "native", verify=False)
    assert report.num_parameters == 134_515_008
    loaded = load_checkpoint(tmp_path / "native", load_format="native")
    assert loaded.tokenizer is not None
    reference_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    converted_tokenizer = AutoTokenizer.from_pretrained(
        tmp_path / "native" / "step-000000" / "tokenizer"
    )
    engine = Engine(loaded.model, TokenizerInfo(loaded.config.vocab_size, eos_id=None))
    for question in ("What is the capital of France?", "Write a haiku about rain."):
        chat = [{"role": "user", "content": question}]
        text = converted_tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
        assert text == reference_tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
        ids = loaded.tokenizer.encode(text)
        assert ids == reference_tokenizer(text).input_ids
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                pad_token_id=2, top_k=None, top_p=None, temperature=None,
            )[0, len(ids):].tolist()  # fmt: skip
        [[result]] = engine.generate([ids], [SamplingConfig(max_new_tokens=16)])
        assert result.token_ids == expected, (question, loaded.tokenizer.decode(expected))
    shutil.rmtree(tmp_path / "native")
