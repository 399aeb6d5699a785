"""Serving on quantized weights (engine/quantized_model.py, kernels/quant_linear.py,
engine/cpu_decode_quant.h): the engine computes on int8 / int4 codes and gives the logits of the
same model dequantized at load.

- The decode step in C reads the codes and agrees with the lean step on the dequantized weights
  to fp32 rounding (tight: 1e-5 of the largest logit), with greedy tokens equal.
- A quantized checkpoint is served on its codes by default: `QuantLinear` layers, no float copy
  of their weights, the C decode step; greedy tokens equal those of the dequantized load, and a
  merged LoRA adapter or `quantized_weights=False` gives the dequantized model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import native_step
from engine.decode_step import DecodeStep
from engine.engine import Engine, EngineConfig
from engine.loading import load_checkpoint
from engine.native_step import NativeStep
from engine.quantized_model import (
    parameter_count,
    quantize_linears,
    quantized_bytes,
    tie_quantized_head,
    weight_bytes,
)
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from kernels.quant_embedding import QuantEmbedding
from kernels.quant_linear import QuantLinear
from kernels.quantization import WeightScheme
from services.converter.job import ConvertOptions, convert
from tests.engine.test_decode_step import VOCAB
from tests.engine.test_native_step import _model, _one_step, _prefilled
from tests.services.converter.conftest import _randomise

BUILT, WHY = native_step.available()
needs_build = pytest.mark.skipif(not BUILT, reason=WHY)

SCHEMES = [
    WeightScheme(8, None, True),
    WeightScheme(8, 32, False),
    WeightScheme(4, 32, True),
    WeightScheme(4, 16, False),
]


def _quantized_and_dequantized(
    scheme: WeightScheme, embedding: WeightScheme | None = None, **overrides
):
    """The test model with its decoder linears (and with `embedding` its token embedding and
    head) quantized, and a float copy holding exactly the weights the codes stand for."""
    quant = _model(**overrides)
    quantize_linears(quant, scheme, embedding)
    floats = _model(**overrides)
    with torch.no_grad():
        for name, module in quant.named_modules():
            if isinstance(module, (QuantLinear, QuantEmbedding)):
                floats.get_submodule(name).weight.copy_(module.dequantized())
    return quant, floats


@needs_build
@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize(
    "overrides", [{}, {"attention_bias": True, "mlp_bias": True}], ids=["gqa", "biases"]
)
@pytest.mark.parametrize("lengths", [(6,), (3, 9, 1)], ids=["one", "three"])
def test_c_step_on_codes_gives_the_dequantized_models_logits(scheme, overrides, lengths):
    _assert_c_step_matches(scheme, list(lengths), **overrides)


@needs_build
@pytest.mark.parametrize(
    "scheme",
    [WeightScheme(4, 24, False), WeightScheme(8, 24, True), WeightScheme(4, 8, True)],
    ids=str,
)
def test_c_step_on_groups_not_a_multiple_of_16(scheme):
    """Groups of 24 (the int4 loop's last 8 inputs of a group in natural order, 16 reordered
    before them) and of 8 (int4: no reordering at all) on a hidden-48, ffn-120 model."""
    _assert_c_step_matches(scheme, [3, 9, 1], hidden_size=48, ffn_hidden_size=120)


EMBEDDINGS = [WeightScheme(8, None, True), WeightScheme(4, 16, False)]
"""The embedding/head schemes tested: what `convert` writes, and int4 with zero points (the C
lookup's other branch)."""


@needs_build
@pytest.mark.parametrize("embedding", EMBEDDINGS, ids=str)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("lengths", [(6,), (3, 9, 1)], ids=["one", "three"])
def test_c_step_on_a_quantized_embedding_and_head(embedding, tied, lengths):
    """The embedding's rows dequantized in C, the head's product on the same codes (tied) or its
    own (untied): the dequantized model's logits; no float table is held."""
    _assert_c_step_matches(
        WeightScheme(4, 32, False), list(lengths), embedding, tie_word_embeddings=tied
    )


def test_a_quantized_embedding_looks_up_the_dequantized_rows_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        for embedding in EMBEDDINGS:
            quant, floats = _quantized_and_dequantized(
                WeightScheme(8, None, True), embedding, tie_word_embeddings=True
            )
            table = quant.embed_tokens
            assert isinstance(table, QuantEmbedding) and isinstance(quant.lm_head, QuantLinear)
            assert quant.lm_head.scale is table.scale  # tied: the same tensors
            assert not any(p.shape == (VOCAB, 64) for p in quant.parameters())
            ids = torch.tensor([[0, 5, VOCAB - 1], [3, 3, 7]])
            with torch.inference_mode():
                assert torch.equal(quant(ids), floats(ids))
            table.dtype = dtype  # rows rounded to the model's dtype as the float table's are
            want = torch.nn.functional.embedding(ids, floats.embed_tokens.weight.to(dtype))
            assert torch.equal(table(ids), want)


def _assert_c_step_matches(
    scheme: WeightScheme, lengths: list[int], embedding: WeightScheme | None = None, **overrides
) -> None:
    """Five C steps on the codes against the lean step on the dequantized weights."""
    quant, floats = _quantized_and_dequantized(scheme, embedding, **overrides)
    native, why = NativeStep.build(DecodeStep(quant))
    assert native is not None, why
    assert native.max_rows > 1  # codes are row-major: batched steps run in C too
    lean = DecodeStep(floats)
    ours = _prefilled(quant, lengths)
    theirs = _prefilled(floats, lengths)
    for key in ours.k_BSKD:  # the prefill ran QuantLinear.forward: the dequantized weights
        assert torch.equal(ours.k_BSKD[key], theirs.k_BSKD[key])
    ids_B1 = torch.arange(7, 7 + len(lengths))[:, None]
    with torch.inference_mode():
        for _ in range(5):
            got, want = _one_step(native, lean, ours, theirs, ids_B1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            ids_B1 = want.argmax(-1, keepdim=True)


@needs_build
def test_groups_the_c_step_cannot_read_run_in_the_lean_step():
    """Groups of 4 inputs are not whole 8-lane vectors: the lean step (QuantLinear.forward)
    runs, on the same dequantized weights."""
    quant, floats = _quantized_and_dequantized(WeightScheme(8, 4, True))
    lean = DecodeStep(quant)
    native, why = NativeStep.build(lean)
    assert native is None and "not a plain" in why
    ours, theirs = _prefilled(quant, [5]), _prefilled(floats, [5])
    got, want = _one_step(lean, DecodeStep(floats), ours, theirs, torch.tensor([[3]]))
    assert torch.equal(got, want)


@needs_build
def test_bf16_model_on_codes_steps_in_c_with_the_upcast_models_tokens():
    """bf16 kept tensors (embedding, norms, cache) around int8 codes: the C step reads both;
    greedy tokens are those of the dequantized weights in fp32 (peaked logits)."""
    quant, floats = _quantized_and_dequantized(WeightScheme(8, None, True))
    with torch.no_grad():
        for model in (quant, floats):
            model.lm_head.weight.mul_(10.0)
    for param in quant.parameters():
        param.data = param.data.to(torch.bfloat16)  # kept tensors only: the codes are buffers
    for name, param in floats.named_parameters():  # the fp32 twin holds the same bf16 values
        if not isinstance(floats.get_submodule(name.rpartition(".")[0]), torch.nn.Linear) or (
            "lm_head" in name
        ):
            param.data = param.data.to(torch.bfloat16).float()
    assert _c_step_greedy(quant) == _c_step_greedy(floats)


def _c_step_greedy(model) -> list[list[int]]:
    """Greedy tokens of two prompts served with the C decode step (asserted to be in use)."""
    prompts = [[5, 9, 11], [7] * 8]
    configs = [SamplingConfig(max_new_tokens=8) for _ in prompts]
    engine = Engine(model, TokenizerInfo(VOCAB), EngineConfig(max_batch_rows=2, cpu_linear="dense"))
    assert isinstance(engine.runner.decode_step, NativeStep)
    return [req[0].token_ids for req in engine.generate(prompts, configs)]


@needs_build
def test_bf16_model_with_a_quantized_tied_embedding_steps_in_c():
    """bf16 norms and cache around int8 layers and an int8 tied embedding/head: the C prefill
    and steps look rows up from the codes (rounded to bf16, as the torch lookup) and give the
    greedy tokens of an fp32 twin holding those rows (peaked logits)."""
    quant, floats = _model(tie_word_embeddings=True), _model(tie_word_embeddings=True)
    with torch.no_grad():
        for model in (quant, floats):
            model.embed_tokens.weight.mul_(10.0)
    int8 = WeightScheme(8, None, True)
    quantize_linears(quant, int8, int8)
    with torch.no_grad():
        for name, module in quant.named_modules():
            if isinstance(module, QuantLinear) and name != "lm_head":
                floats.get_submodule(name).weight.copy_(module.dequantized())
        floats.embed_tokens.weight.copy_(quant.embed_tokens.dequantized().bfloat16().float())
        for name, param in floats.named_parameters():  # norms: the bf16 values, in fp32
            if "norm" in name:
                param.data = param.data.bfloat16().float()
    for param in quant.parameters():
        param.data = param.data.to(torch.bfloat16)
    quant.embed_tokens.dtype = torch.bfloat16
    assert _c_step_greedy(quant) == _c_step_greedy(floats)


def test_scales_of_another_dtype_leave_the_layer_to_torch():
    quant, _ = _quantized_and_dequantized(WeightScheme(8, None, True))
    quant.layers["0"].mlp.down_proj.scale.data = quant.layers["0"].mlp.down_proj.scale.half()
    native, why = NativeStep.build(DecodeStep(quant))
    assert native is None and "not a plain" in why


def _llama_dir(root, *, seed: int, tied: bool):
    """A tiny HF Llama (GQA) whose layer inputs (64, 96) split into groups of 32, with peaked
    logits (no near-ties that fp32 summation order could flip)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = _randomise(LlamaForCausalLM(config), seed=seed)
    with torch.no_grad():
        (model.model.embed_tokens if tied else model.lm_head).weight.mul_(8.0)
    model.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """An untied tiny Llama."""
    return _llama_dir(tmp_path_factory.mktemp("src") / "llama", seed=5, tied=False)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """The `llama` fixture's shape with a tied embedding/head."""
    return _llama_dir(tmp_path_factory.mktemp("src") / "tied", seed=6, tied=True)


@needs_build
@pytest.mark.parametrize(
    ("bits", "group", "affine", "keep"),
    [("int8", None, False, False), ("int4", 32, True, True), ("int4", 32, True, False)],
    ids=["int8", "int4-keep-embedding", "int4"],
)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_quantized_checkpoint_is_served_on_its_codes(
    llama, tied_llama, tmp_path, bits, group, affine, keep, tied
):
    out = tmp_path / "q"
    convert(
        ConvertOptions(
            "hf", "quantized", tied_llama if tied else llama, out,
            quantize=bits, group_size=group, quantize_affine=affine, keep_embedding=keep,
        )
    )  # fmt: skip
    on_codes = load_checkpoint(out)
    dequantized = load_checkpoint(out, quantized_weights=False)
    layers = [m for m in on_codes.model.modules() if isinstance(m, QuantLinear)]
    # q|k|v, o, gate|up, down in each of two layers (+ the head, on the embedding's codes if tied)
    assert len(layers) == 2 * 4 + (not keep)
    assert isinstance(on_codes.model.embed_tokens, QuantEmbedding) is not keep
    assert not any(
        isinstance(m, (QuantLinear, QuantEmbedding)) for m in dequantized.model.modules()
    )
    quant_bytes, other_bytes = quantized_bytes(on_codes.model)
    weights = [m for m in layers if m.in_features != 64 or m.out_features != VOCAB]
    float_quant_bytes = sum(m.in_features * m.out_features * 4 for m in weights)
    per_group = 4 + affine  # fp32 scale (+ int8 zero point)
    groups = sum(m.out_features * m.groups for m in weights)
    table = VOCAB * 64  # the embedding's (and the untied head's) int8 codes, a scale a row
    tables = 0 if keep else 1 + (not tied)
    assert quant_bytes == float_quant_bytes * int(bits[3:]) // 32 + per_group * groups + tables * (
        table + 4 * VOCAB
    )
    assert other_bytes + float_quant_bytes + tables * table * 4 == sum(
        p.numel() * p.element_size() for p in dequantized.model.parameters()
    )
    ids = torch.tensor([[1, 5, 7, 9, 3, 11]])
    with torch.inference_mode():
        assert torch.equal(on_codes.model(ids), dequantized.model(ids))
    prompts = [[5, 9, 11], [7] * 8, [3, 4, 5, 6, 7, 8]]
    configs = [SamplingConfig(max_new_tokens=10) for _ in prompts]
    tokens = []
    for loaded in (on_codes, dequantized):
        engine = Engine(
            loaded.model, TokenizerInfo(VOCAB), EngineConfig(max_batch_rows=3, cpu_linear="dense")
        )
        assert isinstance(engine.runner.decode_step, NativeStep)
        alone = [
            engine.generate([p], [c])[0][0].token_ids for p, c in zip(prompts, configs, strict=True)
        ]
        batch = [req[0].token_ids for req in engine.generate(prompts, configs)]
        tokens.append((alone, batch))
    assert tokens[0] == tokens[1]
    assert tokens[0][0] == tokens[0][1]


def test_quantize_linears_names_a_layer_whose_inputs_do_not_split():
    model = _model()
    with pytest.raises(ValueError, match=r"layers\.0\..*96 inputs does not split into groups"):
        quantize_linears(copy.deepcopy(model), WeightScheme(4, 64, True))


@needs_build
@pytest.mark.slow  # a server process started and a model loaded twice: ~30 s
def test_served_quantized_checkpoint_answers_the_dequantized_models_greedy_tokens(
    tied_llama, tmp_path
):
    """`python -m services.inference serve --load` on an int4 checkpoint with its tied embedding
    and head int8 (convert's defaults but the group), over gRPC, against the same checkpoint
    dequantized in this process: the same greedy tokens."""
    import sys

    import grpc

    from meshline.inference.v1 import inference_pb2 as pb
    from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
    from tests.served_process import GRPC_PORT, launched

    out = tmp_path / "q"
    convert(
        ConvertOptions(
            "hf", "quantized", tied_llama, out, quantize="int4", group_size=32,
            quantize_affine=True,
        )
    )  # fmt: skip
    dequantized = load_checkpoint(out, quantized_weights=False)
    engine = Engine(dequantized.model, TokenizerInfo(VOCAB), EngineConfig(max_batch_rows=1))
    prompts = [[5, 9, 11], [7] * 8]
    want = [
        engine.generate([p], [SamplingConfig(max_new_tokens=10)])[0][0].token_ids for p in prompts
    ]
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(out), "--grace-period", "5"]
    with launched(command, {"grpc": GRPC_PORT}, ready_s=120) as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.ports['grpc']}")
        stub = pb_grpc.InferenceServiceStub(channel)
        got = []
        for prompt in prompts:
            request = pb.GenerateRequest(
                prompt_token_ids=prompt,
                params=pb.SamplingParams(max_new_tokens=10, temperature=0.0),
            )
            got.append(list(stub.Generate(request, timeout=60).sequences[0].token_ids))
        channel.close()
    assert got == want, server.tail()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "scheme", [WeightScheme(8, None, True), WeightScheme(4, 16, False)], ids=str
)
def test_a_quantized_model_counts_the_float_models_parameters_and_its_own_bytes(scheme, tied):
    """The served parameter count (GetModelInfo) and the cache plan's weight size see the
    quantized layers: the count is the float model's, the bytes are the codes' and scales'."""
    quant, floats = _quantized_and_dequantized(scheme, scheme, tie_word_embeddings=tied)
    if tied:
        tie_quantized_head(quant)
    float_count = sum(p.numel() for p in floats.parameters())
    assert parameter_count(quant) == float_count
    assert parameter_count(floats) == float_count
    float_bytes = weight_bytes(floats)
    assert weight_bytes(quant) == sum(quantized_bytes(quant))
    assert weight_bytes(quant) < float_bytes * (0.5 if scheme.bits == 4 else 0.6)
