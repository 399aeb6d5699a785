"""ModelConfig validation, JSON round trip and the named-config registry."""

from __future__ import annotations

import json

import pytest

from models.config import ModelConfig
from models.registry import get_config, list_configs

PUBLISHED = [
    "llama-7B",
    "llama-13B",
    "llama-33B",
    "llama-65B",
    "llama2-7B",
    "llama2-13B",
    "llama2-34B",
    "llama2-70B",
    "baichuan-7B",
    "baichuan-13B",
    "baichuan2-7B",
    "baichuan2-13B",
    "internlm-7B",
    "internlm-65B",
    "aquila-7B",
    "bloom-7B1",
    "bloom-176B",
]
TINY = ["tiny-llama", "tiny-llama-gqa", "tiny-bloom", "tiny-baichuan"]


def test_registry_lists_every_published_and_tiny_config():
    names = list_configs()
    for name in PUBLISHED + TINY:
        assert name in names
        config = get_config(name)
        assert config.extra["registry_name"] == name


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown model config 'llama-1B'.*tiny-llama"):
        get_config("llama-1B")


def test_overrides_apply_and_unknown_override_fails():
    config = get_config("tiny-llama", num_layers=3, fused_qkv=False)
    assert config.num_layers == 3 and not config.fused_qkv
    with pytest.raises(ValueError, match=r"unknown override.*num_layer"):
        get_config("tiny-llama", num_layer=3)


def test_json_round_trip():
    config = get_config("llama2-70B", rope_scaling={"type": "linear", "factor": 2.0})
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    with pytest.raises(ValueError, match="unknown ModelConfig key"):
        ModelConfig.from_dict({**config.to_dict(), "n_embd": 3})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 65}, "hidden_size=65 is not divisible"),
        ({"num_kv_heads": 3}, "num_kv_heads=3"),
        ({"norm_type": "batchnorm"}, "norm_type='batchnorm'"),
        ({"position_embedding": "learned_absolute"}, "position_embedding"),
        ({"activation": "relu"}, "activation='relu'"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"rope_scaling": {"type": "yarn", "factor": 2}}, "rope_scaling"),
        ({"attention_dropout": 1.0}, "attention_dropout"),
    ],
)
def test_invalid_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny-llama", **overrides)


def test_derived_sizes():
    config = get_config("llama2-70B")
    assert config.head_dim == 128 and config.kv_heads == 8 and config.gated
    bloom = get_config("bloom-7B1")
    assert bloom.kv_heads == 32 and not bloom.gated and bloom.tie_word_embeddings
