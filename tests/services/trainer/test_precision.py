"""Mixed precision: --release-fp32-grad equals the default path, overflow skips, clipping."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from services.trainer.train_config import PrecisionSection
from training.optimizer import is_no_decay, param_groups
from training.precision import PrecisionOptimizer, PrecisionPlan, plan_precision


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def _train(model, plan, steps=6, loss_scale=1.0, clip=1.0):
    opt = PrecisionOptimizer(param_groups(model, 0.1), _adamw, plan, clip_grad=clip)
    gen = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(steps):
        x = torch.randn(4, 16, generator=gen).to(next(model.parameters()).dtype)
        (model(x).float().pow(2).mean() * loss_scale).backward()
        norms.append(opt.step(loss_scale).grad_norm)
    return opt, norms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_release_fp32_grad_matches_default(dtype):
    torch.manual_seed(0)
    base = _Net().to(dtype)
    default_model, release_model = copy.deepcopy(base), copy.deepcopy(base)
    scale = 1024.0 if dtype == torch.float16 else 1.0
    opt_default, norms_default = _train(
        default_model, PrecisionPlan("master", dtype), loss_scale=scale
    )
    opt_release, norms_release = _train(
        release_model, PrecisionPlan("master", dtype, release_fp32_grad=True), loss_scale=scale
    )
    assert norms_default == norms_release
    for (name, a), b in zip(
        default_model.named_parameters(), release_model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        assert a.dtype == dtype
    for a, b in zip(opt_default.master_params, opt_release.master_params, strict=True):
        assert torch.equal(a, b)
    numel = sum(p.numel() for p in base.parameters())
    assert opt_default.persistent_grad_bytes() == 4 * numel
    assert opt_release.persistent_grad_bytes() == 0


def test_master_weights_track_small_updates_fp32_would():
    torch.manual_seed(0)
    fp32 = _Net()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    _train(fp32, PrecisionPlan("fp32", torch.float32), steps=3)
    opt, _ = _train(bf16, PrecisionPlan("master", torch.bfloat16), steps=3)
    names = {id(p): n for n, p in bf16.named_parameters()}
    reference = dict(fp32.named_parameters())
    for p, m in zip(opt.model_params, opt.master_params, strict=True):
        # bf16 compute differs from fp32 by its rounding (8 mantissa bits) only.
        assert torch.allclose(reference[names[id(p)]], m, atol=3e-2, rtol=0), names[id(p)]
        assert torch.equal(p, m.to(torch.bfloat16))


def test_overflow_skips_and_keeps_params():
    torch.manual_seed(0)
    model = _Net().to(torch.float16)
    opt = PrecisionOptimizer(
        param_groups(model, 0.1), _adamw, PrecisionPlan("master", torch.float16), clip_grad=1.0
    )
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 16).half()).float().sum().backward()
    model.fc1.weight.grad[0, 0] = float("inf")
    stats = opt.step(loss_scale=2.0**10)
    assert stats.found_inf and math.isnan(stats.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_clipping_bounds_the_update_norm():
    torch.manual_seed(0)
    model = _Net()
    sgd = lambda groups: torch.optim.SGD(groups, lr=1.0)  # noqa: E731
    opt = PrecisionOptimizer(
        param_groups(model, 0.0), sgd, PrecisionPlan("fp32", torch.float32), clip_grad=0.5
    )
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    (model(torch.randn(8, 16)).pow(2).sum() * 100).backward()
    stats = opt.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert stats.grad_norm > 0.5
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(0.5, rel=1e-4)


def test_weight_decay_groups():
    model = _Net()
    groups = param_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed == {id(model.fc1.weight), id(model.fc2.weight)}
    assert is_no_decay("layers.0.input_norm.weight", torch.zeros(4, 4))
    assert is_no_decay("lm_head.bias", torch.zeros(4, 4))
    assert not is_no_decay("embed_tokens.weight", torch.zeros(4, 4))


def test_plan_precision_modes():
    assert plan_precision(PrecisionSection(), 0, 2).mode == "fp32"
    assert plan_precision(PrecisionSection(bf16=True), 0, 2).mode == "master"
    assert plan_precision(PrecisionSection(bf16=True), 1, 2).mode == "autocast"
    assert plan_precision(PrecisionSection(fp16=True), 3, 2).mode == "fsdp"
    # No data-parallel rank to shard over: no FSDP2 to cast, so ZeRO 0's fp32 masters.
    assert plan_precision(PrecisionSection(bf16=True), 2, sharding_ranks=1).mode == "master"
    assert plan_precision(PrecisionSection(bf16=True), 1, sharding_ranks=1).mode == "autocast"
    plan = plan_precision(PrecisionSection(bf16=True, release_fp32_grad=True), 0, 2)
    assert plan.release_fp32_grad and plan.model_dtype == torch.bfloat16


def test_megatron_adam_flag_means_decoupled_weight_decay() -> None:
    import torch

    from training.config_sections import OptimSection
    from training.optimizer import build_inner_optimizer

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = build_inner_optimizer(
        OptimSection(optimizer="adam", lr=0.1, weight_decay=0.5), [{"params": [param]}]
    )
    assert isinstance(optimizer, torch.optim.AdamW)
