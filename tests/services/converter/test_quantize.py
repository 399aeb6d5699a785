"""`meshline convert --save-format quantized --quantize int8|int4`: weight-only RTN checkpoints.

- The stored codes, scales and zero points are `kernels.quantization`'s, the scheme is recorded,
  and reading dequantizes exactly what was stored (every stage that loads through the format
  registry — convert, serve, evaluate — gets the same float model).
- Quality on a real model and real text: SmolLM2-135M-Instruct (from its GGUF file) on a Python
  standard-library source file: int8 perplexity within +1% of the float model's (`slow`).
- Misuse is refused by flag before anything is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.bench_quantize import perplexity, stdlib_text
from checkpoints.hf_format import HFSource
from checkpoints.quantized_format import EMBEDDING_SCHEME, QuantizedSource
from checkpoints.registry import detect_format
from checkpoints.units import units
from kernels.quantization import WeightScheme, dequantize_weight, quantize_weight
from services.converter.job import ConvertOptions, convert
from tests.checkpoints.test_gguf import smollm2_gguf
from tests.services.converter.conftest import _randomise


def _state(source) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for unit in units(source.config):
        state.update(source.read_unit(unit))
    return state


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny HF Llama (GQA, untied head) whose layer inputs (64, 96) split into groups of 32."""
    directory = tmp_path_factory.mktemp("src") / "llama"
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    _randomise(LlamaForCausalLM(config), seed=5).save_pretrained(directory)
    return directory


SCHEMES = [
    ("int8", None, False, WeightScheme(8, None, True)),
    ("int4", 32, False, WeightScheme(4, 32, True)),
    ("int4", 32, True, WeightScheme(4, 32, False)),
    ("int8", 32, True, WeightScheme(8, 32, False)),
]


@pytest.mark.parametrize(
    ("bits", "group", "affine", "scheme", "keep"),
    [(*s, False) for s in SCHEMES] + [(*SCHEMES[2], True)],
)
def test_quantized_checkpoint_stores_rtn_codes_and_reads_them_back(
    llama, tmp_path, bits, group, affine, scheme, keep
):
    out = tmp_path / "q"
    report = convert(
        ConvertOptions(
            "hf", "quantized", llama, out,
            quantize=bits, group_size=group, quantize_affine=affine, keep_embedding=keep,
        )
    )  # fmt: skip
    assert report.verify is None and "rounds the weights" in (report.verify_skipped or "")
    recorded = json.loads((out / "quantization.json").read_text())
    assert recorded == {
        "format": "meshline-quantized-1",
        "method": "rtn",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "symmetric": scheme.symmetric,
        "dtype": "float32",
        # the embedding and (untied) head: int8, one scale per row, unless kept
        "embedding": None if keep else {"bits": 8, "group_size": None, "symmetric": True},
    }
    assert detect_format(out) == "quantized"
    source, back = _state(HFSource(llama)), _state(QuantizedSource(out))
    assert set(source) == set(back)
    for name, tensor in source.items():
        own = None
        if name.startswith("layers.") and tensor.dim() == 2:
            own = scheme
        elif name in ("embed_tokens.weight", "lm_head.weight") and not keep:
            own = EMBEDDING_SCHEME
        if own is not None:
            expected = dequantize_weight(quantize_weight(tensor, own))
            assert torch.equal(back[name], expected), name
            assert not torch.equal(back[name], tensor)
        else:  # norms (and with --keep-embedding the embedding and head) kept
            assert torch.equal(back[name], tensor), name
    # converting the quantized checkpoint on reads it dequantized, exactly
    convert(ConvertOptions("quantized", "hf", out, tmp_path / "hf"))
    again = _state(HFSource(tmp_path / "hf"))
    assert all(torch.equal(again[n], t) for n, t in back.items())


def test_int4_weights_take_half_a_byte(llama, tmp_path):
    for bits in ("int8", "int4"):
        convert(
            ConvertOptions("hf", "quantized", llama, tmp_path / bits, quantize=bits, group_size=32)
        )
    from checkpoints.safetensors_stream import read_header

    header8, _ = read_header(tmp_path / "int8" / "model.safetensors")
    header4, _ = read_header(tmp_path / "int4" / "model.safetensors")
    name = "layers.0.mlp.down_proj.weight"
    assert header8[f"{name}.codes"]["dtype"] == "I8" and header8[f"{name}.codes"]["shape"] == [
        64,
        96,
    ]
    assert header4[f"{name}.packed"]["dtype"] == "U8" and header4[f"{name}.packed"]["shape"] == [
        64,
        48,
    ]
    assert header4[f"{name}.scale"]["shape"] == [64, 3]


def test_misuse_is_refused_by_flag_before_reading(llama, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--quantize None and --save-format quantized go together"):
        ConvertOptions("hf", "quantized", llama, out)
    with pytest.raises(ValueError, match="--save-format native"):
        ConvertOptions("hf", "native", llama, out, quantize="int8")
    with pytest.raises(ValueError, match="--group-size needs a value >= 1 and --quantize"):
        ConvertOptions("hf", "hf", llama, out, group_size=64, dtype="bf16")
    with pytest.raises(ValueError, match="--keep-embedding needs --quantize"):
        ConvertOptions("hf", "hf", llama, out, keep_embedding=True)
    with pytest.raises(ValueError, match="--group-size 128: a row of 64 inputs"):
        convert(ConvertOptions("hf", "quantized", llama, out, quantize="int4"))
    assert not out.exists()


def test_the_registry_detects_quantized_checkpoints_by_their_scheme_file():
    from checkpoints import quantized_format, registry

    assert registry.QUANTIZED_SCHEME == quantized_format.SCHEME_FILE


def test_a_tampered_checkpoint_is_refused(llama, tmp_path):
    out = tmp_path / "q"
    convert(ConvertOptions("hf", "quantized", llama, out, quantize="int8"))
    scheme = json.loads((out / "quantization.json").read_text())
    (out / "quantization.json").write_text(json.dumps({**scheme, "bits": 4}))
    with pytest.raises(ValueError, match=r"packed is missing"):
        QuantizedSource(out)
    (out / "quantization.json").write_text(json.dumps({**scheme, "bits": 3}))
    with pytest.raises(ValueError, match="not a Meshline quantization scheme"):
        QuantizedSource(out)
    # the embedding's scheme is checked as the layers' is, and must match what is stored
    bad = {**scheme, "embedding": {"bits": 8, "group_size": 0, "symmetric": True}}
    (out / "quantization.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"embedding\.group_size 0"):
        QuantizedSource(out)
    (out / "quantization.json").write_text(json.dumps({**scheme, "embedding": None}))
    with pytest.raises(ValueError, match=r"tensor embed_tokens\.weight is missing"):
        QuantizedSource(out)


@pytest.mark.slow
def test_smollm2_int8_perplexity_stays_within_one_percent_of_float(tmp_path):
    """SmolLM2 dequantized from its Q4_1 file is the float model; its int8 per-channel RTN
    checkpoint, loaded as serving loads it, must stay within +1% of its perplexity on real text.
    (int4 RTN does not meet the issue's +5% on this model: bench/RESULTS.md has the numbers.)"""
    from engine.loading import load_checkpoint

    float_dir = tmp_path / "float"
    convert(ConvertOptions("gguf", "native", smollm2_gguf(), float_dir, verify=False))
    convert(ConvertOptions("native", "quantized", float_dir, tmp_path / "int8", quantize="int8"))
    base = load_checkpoint(float_dir, load_format="native")
    assert base.tokenizer is not None
    ids = base.tokenizer.encode(stdlib_text())[:2048]
    reference = perplexity(base.model, ids, 512)
    del base
    loaded = load_checkpoint(tmp_path / "int8")  # --load-format auto finds quantization.json
    assert loaded.load_format == "quantized"
    quantized = perplexity(loaded.model, ids, 512)
    assert quantized != reference and quantized <= reference * 1.01, (reference, quantized)
