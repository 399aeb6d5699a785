"""LR schedules, the loss scaler and batch ramp-up against megatron-core's implementations."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from services.trainer.train_config import PrecisionSection
from training.batching import MicroBatchCalculator, pretraining_batches
from training.loss_scaler import DynamicLossScaler, NoLossScaler, build_loss_scaler
from training.lr_schedule import LRScheduler, lr_at

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class _Groups:
    """The one attribute OptimizerParamScheduler touches on its optimizer."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
@pytest.mark.parametrize("warmup", [0, 10])
def test_lr_matches_megatron(style, warmup):
    max_lr, min_lr, decay = 3e-4, 3e-5, 100
    reference = OptimizerParamScheduler(
        _Groups(),
        init_lr=0.0,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = LRScheduler(
        opt, max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup, decay_steps=decay, decay_style=style
    )
    for step in range(130):
        expected = reference.get_lr(reference.optimizer.param_groups[0])
        assert ours.get_lr() == pytest.approx(expected, rel=1e-12, abs=1e-15), (style, step)
        assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        reference.step(1)
        ours.step()


def test_lr_shape_and_state():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay_style="cosine")
    assert lr_at(0, **kw) == 0.0 and lr_at(5, **kw) == 0.5 and lr_at(10, **kw) == 1.0
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(500, **kw) == 0.1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LRScheduler(opt, **kw)
    sched.step(37)
    other = LRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), **kw)
    other.load_state_dict(sched.state_dict())
    assert other.get_lr() == sched.get_lr() == lr_at(37, **kw)
    with pytest.raises(ValueError, match="--lr-decay-style"):
        lr_at(1, **{**kw, "decay_style": "exp"})
    with pytest.raises(ValueError, match="--lr-warmup-iters"):
        LRScheduler(opt, **{**kw, "warmup_steps": 200})


def test_log_warmup_lag_and_resume_consistency():
    """--lr-warmup-style log and --lr-schedule-lag (DeepSpeed's WarmupLR shape, one step behind);
    a resume must keep both, since they decide which rate a step count means."""
    kw = dict(max_lr=1.0, min_lr=0.0, warmup_steps=4, decay_steps=4, decay_style="constant")
    log = {**kw, "warmup_style": "log"}
    assert lr_at(0, **log) == 0.0 and lr_at(4, **log) == 1.0 and lr_at(9, **log) == 1.0
    assert lr_at(1, **log) == pytest.approx(math.log(2) / math.log(4))
    assert lr_at(3, **log) == 1.0  # log(4) / log(4): DeepSpeed's log warmup peaks a step early
    lagged = [lr_at(k, **kw, lag=1) for k in range(6)]
    assert lagged == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="--lr-warmup-style log needs"):
        lr_at(0, **{**log, "warmup_steps": 1})
    with pytest.raises(ValueError, match="--lr-schedule-lag must be"):
        lr_at(0, **kw, lag=-1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LRScheduler(opt, **log, lag=1)
    sched.step(2)
    state = sched.state_dict()
    resumed = LRScheduler(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), **log, lag=1
    )
    resumed.load_state_dict(state)
    assert resumed.get_lr() == sched.get_lr() == lr_at(1, **log)
    for changed in ({**kw, "lag": 1}, {**log}):
        other = LRScheduler(opt, **changed)
        with pytest.raises(ValueError, match="resume with the checkpoint's values"):
            other.load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("warmup_style", "lag")}
    LRScheduler(opt, **kw).load_state_dict(old)  # a checkpoint from before: linear, lag 0


def test_dynamic_scaler_matches_megatron():
    rng = random.Random(0)
    # megatron-core's constructor allocates on CUDA; its update rule is plain tensor math, so the
    # reference is built with the same fields on CPU and runs megatron's own `update`.
    ref = object.__new__(DynamicGradScaler)
    ref._scale = torch.tensor([2.0**16])
    ref.min_scale = torch.tensor([1.0])
    ref.growth_factor, ref.backoff_factor = torch.tensor([2.0]), torch.tensor([0.5])
    ref.growth_interval, ref.hysteresis = 5, 2
    ref._growth_tracker, ref._hysteresis_tracker = 0, 2
    ours = DynamicLossScaler(2.0**16, 1.0, window=5, hysteresis=2)
    for _ in range(400):
        found_inf = rng.random() < 0.25
        ref.update(found_inf)
        ours.update(found_inf)
        assert ours.scale == float(ref.scale)


def test_scaler_overflow_window_hysteresis():
    s = DynamicLossScaler(1024.0, 256.0, window=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # first overflow spends hysteresis
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0
    s.update(True)
    assert s.scale == 256.0  # floor
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0  # window of clean steps doubles it
    restored = DynamicLossScaler(1.0, 1.0)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()
    assert isinstance(build_loss_scaler(PrecisionSection(bf16=True)), NoLossScaler)
    assert build_loss_scaler(PrecisionSection(fp16=True, loss_scale=8.0)).scale == 8.0
    assert isinstance(build_loss_scaler(PrecisionSection(fp16=True)), DynamicLossScaler)


def test_rampup_matches_megatron():
    gbs, mbs, dp, rampup = 32, 2, 2, [8, 8, 300]
    ref = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 0, *rampup)
    ours = MicroBatchCalculator(gbs, mbs, dp, rampup)
    consumed = 0
    for _ in range(40):
        ref.update(consumed, consistency_check=False)
        assert ours.global_batch(consumed) == ref.get_current_global_batch_size()
        assert ours.num_micro_batches(consumed) == ref.get()
        consumed += ours.global_batch(consumed)
    assert ours.global_batch(consumed) == gbs


def test_sampler_is_dp_size_independent_and_resumes():
    data = list(range(1000))
    one = pretraining_batches(data, 0, 4, 0, 1)
    two = [pretraining_batches(data, 0, 2, r, 2) for r in range(2)]
    for _ in range(5):
        assert next(one) == next(two[0]) + next(two[1])
    resumed = pretraining_batches(data, 8, 4, 0, 1)
    fresh = pretraining_batches(data, 0, 4, 0, 1)
    next(fresh), next(fresh)
    assert next(resumed) == next(fresh)
