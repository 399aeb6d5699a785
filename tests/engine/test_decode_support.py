"""Every `ModelConfig` field is implemented or explicitly declined by each fast decode path.

The tables (`LEAN_SUPPORT`, `NATIVE_SUPPORT`, `GRAPH_SUPPORT`) must have a row per field, and
every row is exercised on a tiny model: a value a path declines makes it decline by the field's
name (the engine then runs the module forward), and a value it implements decodes the same
greedy tokens as the module forward.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine import native_step
from engine.cuda_graphs import GRAPH_SUPPORT
from engine.decode_step import LEAN_SUPPORT, DecodeStep
from engine.engine import Engine, EngineConfig
from engine.native_step import NATIVE_SUPPORT, NativeStep
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from models import build_model
from models.config import ModelConfig
from models.registry import get_config

TABLES = {"lean": LEAN_SUPPORT, "native": NATIVE_SUPPORT, "graphs": GRAPH_SUPPORT}
FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}

VARIANTS: dict[str, list[dict]] = {
    "norm_type": [{"norm_type": "layernorm"}],
    "position_embedding": [{"position_embedding": "alibi"}, {"position_embedding": "learned"}],
    "rope_scaling": [
        {
            "rope_scaling": {
                "type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 128,
            }
        },
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
    ],
    "activation": [{"activation": "gelu"}, {"activation": "gelu_exact"}, {"activation": "geglu"}],
    "attention_bias": [{"attention_bias": True}],
    "qkv_bias": [{"qkv_bias": True}],
    "kv_channels": [{"kv_channels": 32}],
    "qk_norm": [{"qk_norm": True}],
    "sliding_window": [{"sliding_window": 8}],
    "mlp_bias": [{"mlp_bias": True}],
    "tie_word_embeddings": [{"tie_word_embeddings": True}],
    "embedding_layernorm": [{"embedding_layernorm": True}],
    "norm_head": [{"norm_head": True}],
    "fused_qkv": [{"fused_qkv": False}],
    "fused_gate_up": [{"fused_gate_up": False}],
    "num_kv_heads": [{"num_kv_heads": 2}],
    "moe": [{"moe": {"num_experts": 4, "top_k": 2}}],
    "hidden_dropout": [{"hidden_dropout": 0.1}],
    "attention_dropout": [{"attention_dropout": 0.1}],
    "family": [{"family": "gpt"}],
}
"""Non-default values per field (on tiny-llama); fields left out are sizes and metadata, which
every test model already varies."""


def _cases() -> list[tuple[str, dict]]:
    return [(field, overrides) for field, options in VARIANTS.items() for overrides in options]


def _model(overrides: dict) -> torch.nn.Module:
    config = get_config("tiny-llama", **overrides)
    torch.manual_seed(0)
    model = build_model(config, device="cpu").eval()
    with torch.no_grad():
        for param in model.parameters():  # non-trivial biases and norm scales
            param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("path", list(TABLES))
def test_every_field_has_a_row(path):
    assert set(TABLES[path]) == FIELDS, set(TABLES[path]) ^ FIELDS


def _greedy(model, decode_step: str) -> list[int]:
    engine = Engine(
        model, TokenizerInfo(model.config.vocab_size), EngineConfig(decode_step=decode_step)
    )
    prompt = torch.randint(
        4, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)
    )
    [[result]] = engine.generate([prompt.tolist()], [SamplingConfig(max_new_tokens=8)])
    return result.token_ids


@pytest.mark.parametrize("field, overrides", _cases(), ids=lambda v: str(v))
def test_each_row_declines_or_matches_the_module_forward(field, overrides, caplog):
    model = _model(overrides)
    lean_ok = LEAN_SUPPORT[field].implemented(overrides[field]) and all(
        LEAN_SUPPORT[k].implemented(getattr(model.config, k)) for k in FIELDS
    )
    step, why = DecodeStep.build(model)
    if not lean_ok:
        assert step is None and f"ModelConfig.{field}=" in why, why
        with caplog.at_level(logging.INFO, logger="engine.model_runner"):
            Engine(model, TokenizerInfo(model.config.vocab_size))
        assert f"decode step: module forward (ModelConfig.{field}=" in caplog.text
        return
    assert step is not None, why
    assert _greedy(model, "lean") == _greedy(model, "module")
    available, _ = native_step.available()
    if not available:
        return
    native, why = NativeStep.build(step)
    if not NATIVE_SUPPORT[field].implemented(overrides[field]):
        assert native is None and f"ModelConfig.{field}=" in why, why
    else:
        assert native is not None, why
        assert _greedy(model, "auto") == _greedy(model, "module")
