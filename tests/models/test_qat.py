"""Quantization-aware training (models/qat.py): fake-quantized linears with a straight-through
gradient.

- The fake-quantized forward is exactly the quantized model's: a QAT model's logits equal those
  of the same weights quantized into `QuantLinear` layers (what serving a quantized checkpoint
  computes), bit for bit.
- Effect: the same fine-tune with and without `apply_qat(int4)`; quantized to int4 afterwards,
  the QAT model loses less against its own float loss than the plain one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.quantized_model import quantize_linears
from kernels.quantization import WeightScheme
from models import build_model
from models.config import ModelConfig
from models.qat import QATLinear, apply_qat, fake_quantize_weight

INT4 = WeightScheme(4, 32, True)


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=128,
        max_position_embeddings=64,
        init_std=0.1,
    )
    return build_model(config, device="cpu")


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def test_fake_quantized_forward_is_the_quantized_models():
    model = _tiny()
    names = apply_qat(model, INT4)
    assert len(names) == 2 * 4 and all(isinstance(model.get_submodule(n), QATLinear) for n in names)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in _tiny().named_parameters()}
    served = _tiny()
    served.load_state_dict(model.state_dict())
    quantize_linears(served, INT4)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), served(ids))


def test_the_gradient_passes_straight_through():
    weight = torch.randn(8, 64, requires_grad=True)
    fake_quantize_weight(weight, INT4).mul(torch.arange(64.0)).sum().backward()
    assert torch.equal(weight.grad, torch.arange(64.0).expand(8, 64))


def test_refuses_groups_that_do_not_split_a_layer():
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj: a row of 64 inputs"):
        apply_qat(_tiny(), WeightScheme(4, 96, True))


def _fine_tune(model: nn.Module, ids: torch.Tensor, steps: int) -> nn.Module:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        _loss(model, ids).backward()
        optimizer.step()
    return model


@pytest.mark.slow  # ~20 s alone; minutes on the shared 2-core box under load
def test_qat_fine_tune_loses_less_when_quantized_to_int4():
    ids = torch.randint(0, 64, (8, 20), generator=torch.Generator().manual_seed(2))
    plain = _fine_tune(_tiny(), ids, 80)
    qat = _tiny()
    apply_qat(qat, INT4)
    _fine_tune(qat, ids, 80)
    gaps = {}
    with torch.no_grad():
        for name, trained in (("plain", plain), ("qat", qat)):
            floats = _tiny()
            floats.load_state_dict(trained.state_dict())
            quantized = copy.deepcopy(floats)
            quantize_linears(quantized, INT4)
            gaps[name] = (_loss(quantized, ids) - _loss(floats, ids)).item()
            if name == "qat":  # what it trained on is what the quantized model computes
                assert torch.equal(_loss(quantized, ids), _loss(trained, ids))
    assert gaps["qat"] < 0.5 * gaps["plain"], gaps


def test_trainer_qat_flag_trains_fake_quantized_linears(tmp_path):
    """`--qat int4 --qat-group-size 32`: the trainer's decoder linears are QATLinear, the loss
    falls, and the saved checkpoint keeps the plain parameter names (it loads into a plain
    model, which quantized as the flags say computes the trained forward)."""
    from services.trainer.arguments import parse_args
    from tests.finetune.test_trainer_peft import BASE
    from training.loop import Trainer

    trainer = Trainer(
        parse_args([*BASE, "--qat", "int4", "--qat-group-size", "32", "--train-iters", "6"])
    )
    layers = [m for m in trainer.model.modules() if isinstance(m, QATLinear)]
    assert len(layers) == 2 * 4 and all(m.scheme == INT4 for m in layers)
    losses = [trainer.train_step().loss for _ in range(6)]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    names = {n for n, _ in trainer.model.named_parameters()}
    assert "layers.0.self_attn.qkv_proj.weight" in names


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--qat-group-size", "32"], "--qat-group-size needs --qat int8|int4"),
        (["--qat", "int4", "--qat-group-size", "5"], "odd"),
        (["--qat", "int4", "--qat-group-size", "96"], "a row of 64 inputs"),
        (["--qat", "int8", "--lora-target-modules", "dense"], "the base is frozen"),
        (["--qat", "int8", "--tensor-model-parallel-size", "2"], "does not combine"),
    ],
    ids=["group-alone", "odd-group", "group-split", "with-lora", "tp"],
)
def test_trainer_qat_flags_are_refused_by_name(flags, message):
    from services.trainer.arguments import parse_args
    from tests.finetune.test_trainer_peft import BASE
    from training import finetune
    from training.loop import Trainer

    with pytest.raises((ValueError, SystemExit)) as info:
        config = parse_args([*BASE, *flags])
        finetune.check(config)
        Trainer(config)
    assert message in str(info.value) or message in str(info.value.__context__)
