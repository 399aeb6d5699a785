"""The tensor-parallel style registry (`parallel.tp_registry.TP_STYLES`) covers every plan."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from models.parallel_plan import tp_plan
from models.registry import get_config, list_configs
from parallel.tensor_parallel import resolve_tp_plan
from parallel.tp_registry import TP_STYLES, get_style, serving_layouts, training_styles


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_plan_style_of_every_model_is_registered(sequence_parallel):
    used = set()
    for name in list_configs():
        used |= set(tp_plan(get_config(name), sequence_parallel=sequence_parallel).values())
    assert used, "no plan styles found"
    assert used <= set(TP_STYLES), sorted(used - set(TP_STYLES))


def test_replicated_kv_heads_are_registered():
    config = get_config("tiny-llama").replace(fused_qkv=False, num_kv_heads=1)
    model = build_model(config, device="meta")
    resolved = resolve_tp_plan(model, config, 2, sequence_parallel=False)
    assert "kv_replicated" in resolved.values()
    assert all(style in TP_STYLES for style in resolved.values())


def test_every_style_has_a_layout_and_serving_skips_sequence_parallel_ones():
    for name, style in TP_STYLES.items():
        assert style.train or style.serve or style.attribute, name
    built = training_styles(get_config("tiny-llama"), sequence_parallel=True)
    assert set(built) == {n for n, s in TP_STYLES.items() if s.train is not None}
    layouts = serving_layouts()
    assert layouts["sequence_parallel"] is None and "alibi_heads" not in layouts
    assert layouts["colwise"] is not None


def test_unknown_style_names_the_module_and_the_registry():
    with pytest.raises(ValueError, match=r"'diagonal' \(module layers.0.mlp\).*tp_registry"):
        get_style("diagonal", "layers.0.mlp")


def test_serving_refuses_a_style_without_a_layout():
    from parallel.tp_serving import ServingShard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    shard = ServingShard.__new__(ServingShard)
    shard.model = model
    with pytest.raises(ValueError, match="no layout for plan style 'kv_replicated'"):
        shard.apply({"0": "kv_replicated"}, serving_layouts())
