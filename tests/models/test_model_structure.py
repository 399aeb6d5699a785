"""Meta construction, initialisation, pipeline stages with global names, TP plans, counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import build_model
from models.accounting import count_parameters
from models.parallel_plan import check_tp_size, format_plan, match_plan, tp_plan
from models.pipeline import build_stage, split_stages, stages_of_rank
from models.registry import get_config

TINY = ["tiny-llama", "tiny-llama-gqa", "tiny-bloom", "tiny-baichuan", "tiny-internlm"]


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("fused", [True, False])
def test_count_parameters_matches_built_model(name, fused):
    config = get_config(name, fused_qkv=fused, fused_gate_up=fused)
    model = build_model(config)  # meta: nothing allocated
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_meta_build_then_init_is_deterministic():
    config = get_config("tiny-bloom")
    model = build_model(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    other = build_model(config, device="cpu")
    other.init_weights(seed=3)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), other.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    layer = model.layers["0"]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(config.hidden_size))
    assert layer.self_attn.qkv_proj.weight.std().item() == pytest.approx(config.init_std, rel=0.1)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    assert torch.equal(model(ids), other(ids))


def test_bf16_build():
    model = build_model(get_config("tiny-bloom"), device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(torch.randint(0, 256, (1, 4))).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bloom"])
def test_pipeline_stages_chain_to_the_full_model(name):
    config = get_config(name, num_layers=4)
    full = build_model(config, device="cpu").eval()
    full.init_weights(seed=0)
    stages = split_stages(4, 2, virtual_size=2)
    parts = []
    for stage in stages:
        part = build_stage(config, stage)
        part.to_empty(device="cpu")
        # Global names: the stage's keys are a subset of the full model's.
        state = {k: v for k, v in full.state_dict().items() if k in part.state_dict()}
        part.load_state_dict(state, strict=True)
        parts.append(part.eval())
    assert sorted(parts[1].layers.keys()) == ["1"]
    assert "layers.2.mlp.down_proj.weight" in parts[2].state_dict()
    assert parts[0].lm_head is None and parts[-1].embed_tokens is None
    ids = torch.randint(0, config.vocab_size, (2, 10))
    x = ids
    with torch.no_grad():
        for part in parts:
            x = part(x)
        assert torch.allclose(x, full(ids), atol=1e-6)
    assert [s.layer_start for s in stages_of_rank(stages, 0)] == [0, 2]


def test_seeded_init_of_a_stage_equals_the_full_models_values():
    config = get_config("tiny-bloom", num_layers=4)  # tied: the last stage holds a head copy
    full = build_model(config, device="cpu")
    full.init_weights(seed=11)
    reference = full.state_dict()
    for stage in split_stages(4, 2):
        part = build_stage(config, stage)
        part.to_empty(device="cpu")
        part.init_weights(seed=11)
        for name, tensor in part.state_dict().items():
            assert torch.equal(tensor, reference[name]), name
    other = build_model(config, device="cpu")
    other.init_weights(seed=12)
    assert not torch.equal(other.embed_tokens.weight, full.embed_tokens.weight)


def test_tied_last_stage_gets_its_own_head_copy():
    config = get_config("tiny-bloom")
    full = build_model(config, device="cpu")
    first, last = split_stages(2, 2)
    tail = build_stage(full, last)
    assert tail.embed_tokens is None and tail.lm_head is not None
    assert isinstance(tail.lm_head.weight, nn.Parameter)
    head = build_stage(build_model(config, device="cpu"), first)
    assert head.lm_head is None and head.norm is None and head.embed_layernorm is not None


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("fused", [True, False])
def test_tp_plan_covers_every_linear(name, fused):
    config = get_config(name, fused_qkv=fused, fused_gate_up=fused)
    model = build_model(config)
    names = [n for n, _ in model.named_modules()]
    plan = tp_plan(config)
    resolved = match_plan(plan, names)
    linears = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert linears <= resolved.keys()
    for pattern in plan:
        assert match_plan({pattern: "x"}, names), pattern
    assert "lm_head" in format_plan(plan)
    if config.position_embedding == "alibi":
        assert resolved["layers.0.self_attn"] == "alibi_heads"


def test_tp_size_check_names_the_size():
    check_tp_size(get_config("llama2-70B"), 8)
    with pytest.raises(
        ValueError, match="num_kv_heads 8 is not divisible by --tensor-parallel-size 16"
    ):
        check_tp_size(get_config("llama2-70B"), 16)


def test_norm_head_ignores_head_row_scale():
    """Baichuan2's NormHead: logits use unit-norm head rows, so rescaling a row changes nothing."""
    ids = torch.randint(0, 256, (1, 5))
    for norm_head in (True, False):
        model = build_model(get_config("tiny-baichuan", norm_head=norm_head), device="cpu")
        with torch.no_grad():
            before = model(ids)
            model.lm_head.weight[:10].mul_(7.0)
            after = model(ids)
        assert torch.allclose(before, after, atol=1e-6) == norm_head
