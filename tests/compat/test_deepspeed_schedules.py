"""DeepSpeed's scheduler blocks, mapped by `--deepspeed_config`, give DeepSpeed's own per-step
learning rates exactly: Meshline's `LRScheduler` built from the mapped fields against DeepSpeed's
WarmupLR/WarmupDecayLR/WarmupCosineLR classes (the installed deepspeed), each stepping a dummy torch optimizer
the way its engine does (DeepSpeed: `optimizer.step()` then `scheduler.step()`; Meshline: the
rate set before the step, `scheduler.step()` after)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.arguments import parse_args
from training import deepspeed_config
from training.lr_schedule import scheduler_for

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (`make setup` installs it)",
)
STEPS = 30
LR = 3e-4
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "128", "--seq-length", "16", "--mock-data",
        "--train-iters", str(STEPS)]  # fmt: skip


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)


def _deepspeed_rates(kind: str, params: dict[str, Any]) -> list[float]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules

    optimizer = _optimizer()
    scheduler = getattr(lr_schedules, kind)(optimizer, **params)
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])  # the rate this optimizer step uses
        optimizer.step()
        scheduler.step()
    return rates


def _meshline_rates(kind: str, params: dict[str, Any], tmp_path: Path) -> list[float]:
    ds: dict[str, Any] = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    if "warmup_max_lr" not in params and kind != "WarmupCosineLR":  # HF Trainer's "auto":
        # without a scheduler default, --lr's would win
        ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    ds["scheduler"] = {"type": kind, "params": params}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    config = parse_args([*BASE, "--deepspeed_config", str(path)], read_files=True)
    # WarmupCosineLR's decay counts from its warmup's last iteration: only its warmup lags.
    cosine = kind == "WarmupCosineLR"
    assert (config.optim.lr_warmup_lag, config.optim.lr_schedule_lag) == (
        (1, 0) if cosine else (0, 1)
    )
    optimizer = _optimizer()
    scheduler = scheduler_for(  # as training/loop.py builds it
        optimizer, config.optim, config.lr_warmup_iters(), config.lr_decay_iters()
    )
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


CASES = {
    "WarmupLR-log (DeepSpeed's default warmup_type)": (
        "WarmupLR",
        {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 10},
    ),
    "WarmupLR-linear": (
        "WarmupLR",
        {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 8, "warmup_type": "linear"},
    ),
    "WarmupLR-one-step (DeepSpeed warms up over at least 2)": (
        "WarmupLR",
        {"warmup_max_lr": LR, "warmup_num_steps": 1, "warmup_type": "linear"},
    ),
    "WarmupLR-default-warmup (1000 steps, log)": ("WarmupLR", {"warmup_max_lr": LR}),
    "WarmupDecayLR-log": (
        "WarmupDecayLR",
        {"warmup_max_lr": LR, "warmup_num_steps": 6, "total_num_steps": 24},
    ),
    "WarmupDecayLR-default-peak (0.001, not the optimizer's lr)": (
        "WarmupDecayLR",
        {"warmup_num_steps": 6, "total_num_steps": 24},
    ),
    "WarmupDecayLR-linear (the notes' ZeRO-2 example's type)": (
        "WarmupDecayLR",
        {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 10,
         "total_num_steps": 25, "warmup_type": "linear"},
    ),
    "WarmupCosineLR-log": (
        "WarmupCosineLR",
        {"warmup_num_steps": 6, "total_num_steps": 24},
    ),
    "WarmupCosineLR-linear (to cos_min_ratio)": (
        "WarmupCosineLR",
        {"warmup_num_steps": 5, "total_num_steps": 20, "warmup_type": "linear",
         "cos_min_ratio": 0.1},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_mapped_schedule_gives_deepspeeds_rates(case, tmp_path):
    kind, params = CASES[case]
    theirs = _deepspeed_rates(kind, params)
    ours = _meshline_rates(kind, params, tmp_path)
    assert theirs[:2] == [0.0, 0.0]  # DeepSpeed's first two steps: iteration -1, then 0
    peak = params.get("warmup_max_lr", 1e-3 if kind == "WarmupDecayLR" else LR)
    if "warmup_num_steps" in params and kind != "WarmupCosineLR":  # the peak within the run
        assert max(theirs) == pytest.approx(peak)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-12)


def test_the_lag_and_log_warmup_rows():
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": LR}}}
    rows = {r.key: r for r in deepspeed_config.map_config(ds, {}).rows}
    assert "--lr-schedule-lag 1 (DeepSpeed's scheduler steps after the optimizer)" in (
        rows["scheduler.type"].setting
    )
    absent = rows["scheduler.params.warmup_type"]
    assert (absent.value, absent.status, absent.fields) == (
        "(absent)",
        "applied",
        ("lr_warmup_style",),
    )
    # WarmupDecayLR without warmup_max_lr peaks at 0.001 whatever the optimizer's lr says.
    decay = {"optimizer": {"type": "AdamW", "params": {"lr": LR}},
             "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"warmup_max_lr means --lr 0\.001 but optimizer"):
        deepspeed_config.map_config(decay, {})
