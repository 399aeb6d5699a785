"""`meshline convert --quantize int4|int8 --quantize-method gptq --calibration-data PREFIX`:
GPTQ-rounded quantized checkpoints, calibrated layer by layer on a Megatron token shard.

- a layer's codes are `kernels.gptq.gptq_quantize` of its weights under the Hessian of its
  inputs on the calibration windows: the embedding rounded as stored, every earlier layer
  quantized (sequential calibration); the scheme records method gptq;
- the checkpoint is the same format: served on its codes with the C step, greedy decoding gives
  the dequantized model's tokens;
- on held-out tokens its logits are closer to the float model's than round to nearest's;
- the calibration flags are refused by name when misused, before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints.hf_format import HFSource
from checkpoints.quantized_format import EMBEDDING_SCHEME, QuantizedSource
from checkpoints.units import units
from engine.engine import Engine, EngineConfig
from engine.loading import load_checkpoint
from engine.native_step import NativeStep
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from kernels.gptq import GptqSettings, HessianAccumulator, gptq_quantize
from kernels.quantization import WeightScheme, dequantize_weight, quantize_weight
from models import build_model
from services.converter.calibration import calibration_tokens
from services.converter.cli import main as convert_main
from services.converter.job import ConvertOptions, convert
from tests.engine.test_native_step import BUILT, WHY
from tests.services.converter import test_quantize

SAMPLES, LENGTH = 12, 32
llama = test_quantize.llama
"""The tiny HF Llama fixture (GQA, untied head, layer inputs of 64 and 96: groups of 32)."""


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    """Token documents of uneven lengths (windows cross their boundaries) for a 100-id model."""
    from tokendata.indexed import IndexedDatasetWriter

    prefix = tmp_path_factory.mktemp("calib") / "calib_text_document"
    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.default_rng(0)
    for length in (50, 130, 7, 300, 90, 61):
        # a skewed unigram distribution, so the inputs are far from isotropic
        writer.add_document(rng.zipf(1.6, length).clip(1, 99))
    writer.finalize()
    return prefix


def _float_model(directory: Path) -> torch.nn.Module:
    source = HFSource(directory)
    model = build_model(source.config, device="cpu")
    state = {}
    for unit in units(source.config):
        state.update(source.read_unit(unit))
    model.load_state_dict(state, strict=False)
    return model.eval()


def _gptq(llama: Path, shard: Path, out: Path, **extra) -> None:
    convert(
        ConvertOptions(
            "hf", "quantized", llama, out, quantize="int4", group_size=32,
            quantize_method="gptq", calibration_data=shard, calibration_samples=SAMPLES,
            calibration_seq_len=LENGTH, **extra,
        )
    )  # fmt: skip


@pytest.mark.parametrize("affine", [False, True])
def test_layer_codes_are_gptq_of_their_sequential_calibration_inputs(
    llama, shard, tmp_path, affine
):
    """Layer 0's q|k|v from the windows' embedded (int8-rounded embedding), normed inputs;
    layer 1's from layer 0's outputs computed with layer 0's stored (quantized) weights."""
    out = tmp_path / "gptq"
    _gptq(llama, shard, out, quantize_affine=affine)
    recorded = json.loads((out / "quantization.json").read_text())
    assert recorded["method"] == "gptq" and recorded["group_size"] == 32
    model = _float_model(llama)
    tokens = calibration_tokens(shard, SAMPLES, LENGTH, model.config)
    scheme = WeightScheme(4, 32, not affine)
    source = QuantizedSource(out)
    with torch.no_grad():
        embedding = dequantize_weight(quantize_weight(model.embed_tokens.weight, EMBEDDING_SCHEME))
        h = torch.nn.functional.embedding(tokens, embedding)
        rope = model.rotary(torch.arange(LENGTH).expand(SAMPLES, LENGTH))
        for index in (0, 1):
            layer = model.layers[str(index)]
            hessian = HessianAccumulator(h.shape[-1])
            hessian.add(layer.input_layernorm(h))
            name = f"layers.{index}.self_attn.qkv_proj.weight"
            weight = layer.self_attn.qkv_proj.weight
            want = gptq_quantize(weight, hessian.hessian, scheme, GptqSettings())
            _, stored = source.read_unit_quantized(index)
            assert torch.equal(stored[name].codes, want.codes)
            # scales to float32 rounding: the converter sums the Hessian in batches of windows
            torch.testing.assert_close(stored[name].scale, want.scale, rtol=1e-5, atol=0)
            assert not torch.equal(stored[name].codes, quantize_weight(weight, scheme).codes)
            for stored_name, q in stored.items():  # the next layer sees this one quantized
                layer.get_submodule(
                    stored_name.split(".", 2)[2].removesuffix(".weight")
                ).weight.copy_(dequantize_weight(q))
            h = layer(h, rope)


@pytest.mark.skipif(not BUILT, reason=WHY)
def test_a_gptq_checkpoint_is_served_on_its_codes(llama, shard, tmp_path):
    out = tmp_path / "gptq"
    _gptq(llama, shard, out, gptq_act_order=True)
    prompts = [[5, 9, 11], [7] * 8]
    greedy = []
    for quantized_weights in (True, False):
        loaded = load_checkpoint(out, quantized_weights=quantized_weights)
        engine = Engine(loaded.model, TokenizerInfo(100), EngineConfig(max_batch_rows=2))
        if quantized_weights:
            assert isinstance(engine.runner.decode_step, NativeStep)
        configs = [SamplingConfig(max_new_tokens=8) for _ in prompts]
        greedy.append([r[0].token_ids for r in engine.generate(prompts, configs)])
    assert greedy[0] == greedy[1]


def test_gptq_logits_are_closer_to_float_than_rtn(llama, shard, tmp_path):
    """Held-out tokens (another draw) through the float, RTN and GPTQ models."""
    _gptq(llama, shard, tmp_path / "gptq")
    rtn = tmp_path / "rtn"
    convert(ConvertOptions("hf", "quantized", llama, rtn, quantize="int4", group_size=32))
    held_out = torch.from_numpy(np.random.default_rng(1).zipf(1.6, (4, 48)).clip(1, 99))
    with torch.no_grad():
        exact = _float_model(llama)(held_out)
        errors = {
            name: float((load_checkpoint(tmp_path / name).model(held_out) - exact).square().mean())
            for name in ("gptq", "rtn")
        }
    assert errors["gptq"] < 0.9 * errors["rtn"], errors


def test_calibration_misuse_is_refused_by_flag(llama, shard, tmp_path, capsys):
    out = tmp_path / "never"
    base = ["--load-format", "hf", "--save-format", "quantized", "--load-dir", str(llama),
            "--save-dir", str(out), "--quantize", "int4", "--group-size", "32"]  # fmt: skip
    cases = [
        (["--quantize-method", "gptq"], "--calibration-data PREFIX"),
        (["--calibration-samples", "4"], "--calibration-samples needs --quantize-method gptq"),
        (["--gptq-act-order"], "--gptq-act-order needs --quantize-method gptq"),
        (["--method", "gptq", "--calibration-data", str(shard), "--gptq-damp", "0"],
         "--gptq-damp must be in (0, 1]"),
        (["--method", "gptq", "--calibration-data", str(shard), "--calibration-samples", "0"],
         "--calibration-samples must be in"),
        (["--method", "gptq", "--calibration-data", str(shard), "--calibration-samples", "4096",
          "--calibration-seq-len", "4096"], "at most 1048576"),
    ]  # fmt: skip
    for extra, message in cases:
        assert convert_main(base + extra) == 2
        assert message in capsys.readouterr().err
    # refused after the flags parse but before any weight is read: files and their contents
    cases = [
        (["--calibration-data", str(tmp_path / "missing")], "is missing"),
        (["--calibration-seq-len", "65"], "exceeds the model's context of 64"),
        (["--calibration-samples", "30"], "fewer than --calibration-samples 30"),
    ]
    for extra, message in cases:
        args = ["--method", "gptq", "--calibration-data", str(shard), "--calibration-seq-len", "32"]
        args += extra
        assert convert_main(base + args) == 1
        err = capsys.readouterr().err
        assert message in err and "--calibration-" in err
        assert not out.exists()


def test_token_ids_outside_the_vocabulary_are_refused(llama, tmp_path):
    from tokendata.indexed import IndexedDatasetWriter

    prefix = tmp_path / "wide"
    writer = IndexedDatasetWriter(prefix, np.int32)
    writer.add_document(np.arange(1000) % 300)
    writer.finalize()
    with pytest.raises(ValueError, match=r"token id 299 is outside the model's vocabulary"):
        _gptq(llama, prefix, tmp_path / "never")
    assert not (tmp_path / "never").exists()
