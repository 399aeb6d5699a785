"""QLoRA (models/qlora.py, kernels/nf4.py): LoRA over a frozen base held as NF4, int4 or int8.

- NF4: every value gets the nearest of QLoRA's 16 table values times its block's absmax; table
  values round-trip exactly.
- Parity with peft: the Meshline model whose base is quantized and an HF model whose base holds
  the dequantized weights, with the same adapters under peft: logits, the loss and one step's
  adapter gradients agree within 1e-5 (fp32).
- The float base weights are dropped: the held bytes shrink by the expected amount.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from kernels.nf4 import BLOCK, NF4_TABLE, NF4Weight, nf4_dequantize, nf4_quantize
from models.hf_adapters import to_hf
from models.lora import LoraConfig, LoraLinear, apply_lora
from models.lora_io import PEFT_PREFIX, save_lora, to_peft
from models.qlora import QLoraLinear, quantize_lora_base
from services.trainer.arguments import parse_args
from tests.finetune.test_lora_peft import _base_pair, _randomise_lora, _tokens
from tests.finetune.test_trainer_peft import BASE, LORA
from tests.finetune.test_trainer_peft import base_ckpt as _base_ckpt
from training import finetune
from training.loop import Trainer

ATOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection, unfused: peft has one A per projection, so gradients compare one to one."""


def test_nf4_picks_the_nearest_table_value_per_block():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 128, generator=gen)
    packed, absmax = nf4_quantize(weight)
    assert packed.dtype == torch.uint8 and packed.numel() == weight.numel() // 2
    assert absmax.shape == (weight.numel() // BLOCK,)
    got = nf4_dequantize(packed, absmax, weight.shape, torch.float32)
    table = torch.tensor(NF4_TABLE)
    scaled = weight.reshape(-1, BLOCK) / absmax[:, None]
    nearest = table[(scaled[..., None] - table).abs().argmin(-1)] * absmax[:, None]
    assert torch.equal(got, nearest.reshape(weight.shape))
    # the table's own values (times a block's absmax) come back exactly, 0 included
    exact = table.repeat(BLOCK // 16 * 2) * 0.5
    exact[0] = -0.5  # the block's absmax
    assert torch.equal(NF4Weight(exact.reshape(2, -1)).dequantized(), exact.reshape(2, -1))


def test_nf4_refuses_a_weight_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="NF4 blocks of 64 values: a weight of 96 values"):
        nf4_quantize(torch.randn(3, 32))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["nf4", "int4", "int8"])
def test_one_step_equals_peft_on_the_dequantized_base(tmp_path, kind):
    from models.registry import get_config

    config = get_config("tiny-llama", fused_qkv=False, fused_gate_up=False)
    hf, ours = _base_pair(config)
    lora = LoraConfig(r=4, alpha=8.0, target_modules=TARGETS)
    apply_lora(ours, lora, seed=3)
    _randomise_lora(ours, seed=5)  # B != 0, so a wrong B or base shows in the gradients
    float_bytes = sum(m.weight.numel() * 4 for m in ours.modules() if type(m) is LoraLinear)
    before, after = quantize_lora_base(ours, kind)
    layers = [m for m in ours.modules() if isinstance(m, QLoraLinear)]
    assert before == float_bytes and len(layers) == 7 * config.num_layers
    per_weight = {"nf4": 0.5 + 4 / BLOCK, "int4": 0.5 + 4 / 64, "int8": 1.0}[kind]
    rows = sum(m.out_features for m in layers) if kind == "int8" else 0
    assert after == pytest.approx(float_bytes / 4 * per_weight + 4 * rows)
    # The HF twin: the dequantized base weights, and the same adapters through peft's files.
    base = {n: t for n, t in ours.state_dict().items() if ".lora_" not in n and ".base." not in n}
    for name, module in ours.named_modules():
        if isinstance(module, QLoraLinear):
            base[f"{name}.weight"] = module.weight.detach()
    hf.load_state_dict(to_hf(base, config), strict=False)
    save_lora(ours, lora, config, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter"), is_trainable=True)
    x = _tokens(config.vocab_size)
    ours.train(), peft_model.train()
    ours_logits = ours(x)
    peft_logits = peft_model(x).logits
    assert (ours_logits - peft_logits).abs().max().item() <= ATOL
    loss = torch.nn.functional.cross_entropy(ours_logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    peft_loss = torch.nn.functional.cross_entropy(
        peft_logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()
    )
    loss.backward(), peft_loss.backward()
    ours_grads, _ = to_peft(_grads(ours), lora, config)
    peft_grads = {
        n.replace(".default", ""): p.grad
        for n, p in peft_model.named_parameters()
        if p.requires_grad
    }
    assert set(ours_grads) == set(peft_grads) and ours_grads
    for name, grad in ours_grads.items():
        assert name.startswith(PEFT_PREFIX)
        torch.testing.assert_close(grad, peft_grads[name], rtol=0, atol=ATOL)
    # the base gets no gradient and holds no float weight
    assert not any(".weight" in n and "lora_" not in n for n in _grads(ours) if ".layers." in n)
    assert all(not isinstance(getattr(m, "base", None), torch.Tensor) for m in layers)


def test_base_quant_needs_lora_layers():
    from models.registry import get_config

    _, ours = _base_pair(get_config("tiny-llama"))
    with pytest.raises(ValueError, match="--base-quant nf4: the model has no LoRA layer"):
        quantize_lora_base(ours, "nf4")


def _held_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


base_ckpt = _base_ckpt  # the fixture: a briefly trained tiny Llama checkpoint


def test_trainer_base_quant_trains_adapters_over_an_nf4_base(base_ckpt):
    """`--base-quant nf4` through the trainer: the loaded float base becomes NF4 before the first
    step (the held bytes drop by what the float weights took less their NF4 form), the loss
    falls, and only adapters change."""
    base, _ = base_ckpt
    flags = [*BASE, *LORA, "--load", str(base), "--finetune", "--base-quant", "nf4"]
    trainer = Trainer(parse_args([*flags, "--train-iters", "8"]))
    trainer.load()
    loaded_bytes = _held_bytes(trainer.model)
    losses = [trainer.train_step().loss for _ in range(8)]
    layers = [m for m in trainer.model.modules() if isinstance(m, QLoraLinear)]
    assert layers and not any(type(m) is LoraLinear for m in trainer.model.modules())
    float_bytes = sum(m.in_features * m.out_features * 4 for m in layers)
    nf4_bytes = sum(m.base.weight_bytes() for m in layers)
    assert nf4_bytes == pytest.approx(float_bytes * (0.5 + 4 / BLOCK) / 4)
    assert _held_bytes(trainer.model) == loaded_bytes - float_bytes + nf4_bytes
    assert sum(losses[-2:]) < sum(losses[:2]), losses


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--base-quant nf4 quantizes the frozen base under LoRA adapters"),
        ([*LORA, "--tensor-model-parallel-size", "2"], "does not combine with --tensor-model"),
        ([*LORA, "--zero-stage", "3"], "does not combine with --zero-stage 2/3"),
    ],
    ids=["no-lora", "tp", "zero3"],
)
def test_trainer_refuses_base_quant_where_it_cannot_apply(extra, message):
    with pytest.raises(ValueError) as info:
        finetune.check(parse_args([*BASE, *extra, "--base-quant", "nf4"]))
    assert message in str(info.value)
