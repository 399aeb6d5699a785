"""Megatron's GPT (family "gpt": learned absolute positions, LayerNorm, GeLU, biases) against
transformers' GPT-2 (fp32, CPU, tiny random models).

transformers writes a random `GPT2LMHeadModel` with `save_pretrained`; Meshline reads it through
the inference engine's `--load-format hf` reader and must give its logits (1e-5) and its greedy
tokens; the state dict and config.json round-trip HF → native → HF exactly. Both GeLU forms
(GPT-2's tanh `gelu_new`, Megatron's default erf `gelu`) and tied and untied heads are covered,
and the learned positions are shown to matter (dropping them changes the logits).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from engine.engine import Engine
from engine.loading import load_checkpoint
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from models.hf_adapters import config_from_hf, from_hf, hf_config, to_hf
from models.registry import get_config
from tests.services.inference.helpers import hf_generate, prompt

ATOL = 1e-5
CASES = {
    "gpt2": {},
    "megatron-gelu-untied": {"activation": "gelu_exact", "tie_word_embeddings": False},
}


def gpt2_model(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """A random transformers GPT-2 for `tiny-gpt` (norm scales and biases randomised too)."""
    fields = hf_config(get_config("tiny-gpt", **overrides))
    fields.pop("model_type"), fields.pop("architectures")
    hf = GPT2LMHeadModel._from_config(GPT2Config(**fields), attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            scale_one = "ln_" in name and name.endswith("weight")
            param.copy_(1.0 + 0.2 * noise if scale_one else 0.15 * noise)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """(overrides, HF model, its save_pretrained directory)."""
    hf = gpt2_model(**CASES[request.param])
    directory = tmp_path_factory.mktemp("gpt2") / request.param
    hf.save_pretrained(directory)
    return CASES[request.param], hf, directory


def _ids(vocab: int, seq: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


def test_load_format_hf_gives_gpt2_logits(saved):
    overrides, hf, directory = saved
    loaded = load_checkpoint(directory, load_format="hf")
    assert loaded.config.family == "gpt" and loaded.config.position_embedding == "learned"
    assert loaded.config.activation == overrides.get("activation", "gelu")
    ids = _ids(loaded.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
        got = loaded.model(ids)
        assert (got - expected).abs().max().item() <= ATOL
        # Positions matter: the same weights without the position table give other logits.
        loaded.model.embed_positions.weight.zero_()
        assert (loaded.model(ids) - expected).abs().max().item() > 1e-3


def test_state_dict_and_config_round_trip_exactly(saved):
    overrides, hf, directory = saved
    config = get_config("tiny-gpt", **overrides)
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith("attn.bias")}
    back = to_hf(from_hf(state, config), config)
    if config.tie_word_embeddings:
        back["lm_head.weight"] = back["transformer.wte.weight"]
    assert set(back) == set(state)
    for key, tensor in state.items():
        assert torch.equal(back[key], tensor), key
    on_disk = json.loads((directory / "config.json").read_text())
    ours = config_from_hf(on_disk)
    for field in config.__dataclass_fields__:
        if field != "extra":
            assert getattr(ours, field) == getattr(config, field), field
    for key, value in hf_config(ours).items():
        if key in on_disk and key not in ("architectures", "dtype"):
            assert on_disk[key] == value, key


def test_gpt2model_names_without_prefix_are_read():
    hf = gpt2_model()
    config = get_config("tiny-gpt")
    bare = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    ours = from_hf(bare, config)
    assert torch.equal(ours["embed_positions.weight"], hf.transformer.wpe.weight)
    assert torch.equal(
        ours["layers.1.self_attn.qkv_proj.weight"], hf.transformer.h[1].attn.c_attn.weight.t()
    )


def test_greedy_tokens_equal_hf_generate(saved):
    _, hf, directory = saved
    loaded = load_checkpoint(directory, load_format="hf")
    vocab = loaded.config.vocab_size
    ids = prompt(24, vocab, seed=3)
    expected = hf_generate(hf, ids, max_new_tokens=12, eos_token_id=None)
    engine = Engine(loaded.model, TokenizerInfo(vocab, eos_id=None))
    [[greedy]] = engine.generate([ids], [SamplingConfig(max_new_tokens=12)])
    assert greedy.token_ids == expected[0, 24:].tolist()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_kv_heads": 2}, "num_kv_heads"),
        ({"attention_bias": False}, "attention_bias"),
        ({"norm_type": "rmsnorm"}, "norm_type"),
        ({"activation": "swiglu", "ffn_hidden_size": 128}, "activation"),
    ],
)
def test_what_gpt2_cannot_express_is_an_error_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        hf_config(get_config("tiny-gpt", **change))


def test_unsupported_gpt2_config_keys_are_refused():
    fields = hf_config(get_config("tiny-gpt"))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        config_from_hf({**fields, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="activation_function"):
        config_from_hf({**fields, "activation_function": "relu"})


def test_parameter_count_includes_the_position_table():
    from models import build_model
    from models.accounting import count_parameters

    config = get_config("tiny-gpt")
    model = build_model(config, device="meta")
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_convert_hf_native_hf_is_bit_identical_and_loads_in_transformers(saved, tmp_path):
    from safetensors.torch import load_file

    from services.converter.job import ConvertOptions, convert

    _, hf, directory = saved
    native, back = tmp_path / "native", tmp_path / "hf"
    convert(ConvertOptions("hf", "native", directory, native))
    convert(ConvertOptions("native", "hf", native, back))
    start, end = load_file(directory / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(start) == sorted(end)
    for name in start:
        assert torch.equal(start[name], end[name]), name
    again = GPT2LMHeadModel.from_pretrained(back, attn_implementation="eager").eval()
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
