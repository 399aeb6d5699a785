"""The typed `ModelConfig.moe` field: JSON round trip, old files with `extra["moe"]` converted on
load (config dicts and a native checkpoint saved that way), hostile values named, one builder."""

from __future__ import annotations

import json

import pytest
import torch

from engine.loading import load_checkpoint
from models import ModelConfig, MoEConfig, build_model
from models.moe import MoE, moe_layers
from models.registry import get_config, list_configs
from training.checkpoint import CheckpointManager, TrainState

MOE_NAMES = [n for n in list_configs() if get_config(n).moe is not None]


def _legacy(config: ModelConfig) -> dict:
    """`config` as config.json was written before `moe` was a field."""
    data = config.to_dict()
    moe = data.pop("moe")
    return {**data, "extra": {**data["extra"], "moe": moe}}


def test_every_moe_family_is_registered_with_a_typed_moe():
    assert {"tiny-mixtral", "tiny-qwen2-moe", "mixtral-8x7B", "qwen3-30B-A3B"} <= set(MOE_NAMES)
    assert get_config("tiny-llama").moe is None


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_config_round_trips_through_json(name):
    config = get_config(name)
    assert isinstance(config.moe, MoEConfig) and "moe" not in config.extra
    text = json.dumps(config.to_dict())
    assert json.loads(text)["moe"]["num_experts"] == config.moe.num_experts
    assert ModelConfig.from_dict(json.loads(text)) == config


@pytest.mark.parametrize("name", MOE_NAMES)
def test_old_files_with_extra_moe_are_converted(name):
    config = get_config(name)
    old = json.loads(json.dumps(_legacy(config)))
    assert "moe" not in old
    assert ModelConfig.from_dict(old) == config


def test_extra_moe_is_refused_outside_from_dict_and_conflicts_are_named():
    with pytest.raises(ValueError, match=r"pass the MoE settings as ModelConfig\(moe="):
        ModelConfig(extra={"moe": {"num_experts": 4, "top_k": 2}})
    config = get_config("tiny-mixtral")
    both = {**config.to_dict(), "extra": {"moe": {"num_experts": 8, "top_k": 1}}}
    with pytest.raises(ValueError, match='both "moe" and the older extra'):
        ModelConfig.from_dict(both)


@pytest.mark.parametrize(
    "moe,message",
    [
        ("four experts", "expected an object of MoEConfig fields"),
        ({"num_experts": "4"}, r"MoEConfig.num_experts='4': must be an integer"),
        ({"num_experts": True}, "must be an integer"),
        ({"num_experts": 10**9}, "more than any real model"),
        ({"num_experts": 4, "top_k": 5}, "--moe-router-topk 5 must be in"),
        ({"num_experts": 4, "experts_per_token": 2}, r"unknown MoEConfig key\(s\) \['experts_per"),
    ],
)
def test_hostile_moe_values_are_named(moe, message):
    data = {**get_config("tiny-mixtral").to_dict(), "moe": moe}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(data)


def test_one_builder_for_dense_and_moe():
    dense = build_model(get_config("tiny-llama"))
    assert not moe_layers(dense)
    config = get_config("tiny-mixtral")
    model = build_model(config)
    layers = moe_layers(model)
    assert len(layers) == config.num_layers
    assert all(isinstance(m, MoE) and m.config == config.moe for _, m in layers)
    assert [n for n, _ in layers] == ["layers.0.mlp", "layers.1.mlp"]
    # A dict is accepted and converted (registry overrides, replace()).
    assert config.replace(moe={"num_experts": 2, "top_k": 1}).moe == MoEConfig(2, 1)


def test_native_checkpoint_saved_with_extra_moe_still_loads(tmp_path):
    config = get_config("tiny-mixtral")
    model = build_model(config, device="cpu")
    model.init_weights(seed=5)
    manager = CheckpointManager(tmp_path / "save", model_config=_legacy(config))
    manager.save(3, TrainState(model, extra={"step": 3}, save_rng=False))
    manager.wait()
    saved = json.loads((tmp_path / "save" / "step-000003" / "config.json").read_text())
    assert saved["extra"]["moe"] == config.moe.to_dict() and "moe" not in saved
    loaded = load_checkpoint(tmp_path / "save")
    assert loaded.config == config
    ids = torch.tensor([[5, 9, 33, 7, 100, 42, 18]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), model(ids))
