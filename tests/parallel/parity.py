"""Shared loss-parity helper: train the same tiny model in a layout and on one process, compare.

tiny-llama-gqa (hidden 64, 4 heads, 2 KV heads, 4 layers, vocab 256, fused qkv and gate_up), sequence 32, global batch 8
in micro-batches of 2, AdamW lr 1e-3, clip 1.0, fp32, mock data, 20 steps by default.
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.arguments import parse_args
from training.loop import Trainer

STEPS = 20
BASE = ["--model", "tiny-llama-gqa", "--num-layers", "4", "--mock-data", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "0",
        "--lr", "1e-3", "--log-interval", "1000"]  # fmt: skip


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a plain tensor (DTensors: full_tensor) under its global name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        data = param.detach()
        out[name] = data.full_tensor() if isinstance(data, DTensor) else data.clone()
    return out


def run_layout(rank: int, world_size: int, flags: list[str], steps: int) -> dict[str, Any]:
    """Body for `run_distributed`: the loss curve and final parameters of one layout."""
    trainer = Trainer(parse_args([*BASE, "--train-iters", str(steps), *flags]))
    losses = [trainer.train_step().loss for _ in range(steps)]
    return {"losses": losses, "params": full_parameters(trainer.model)}


def reference(steps: int = STEPS) -> dict[str, Any]:
    """The single-process run (in a child process, single-threaded like the layouts' ranks)."""
    from tests.harness import run_distributed

    return run_distributed(run_layout, 1, [], steps)[0]


def max_param_diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor relative difference ||got - ref|| / ||ref|| over the parameters `got`
    holds (a pipeline stage: its own). Relative norms, because Adam moves entries whose gradient
    is near zero by up to ~lr per step whatever its size, so single entries are a noisy measure."""
    assert set(got) <= set(ref), sorted(set(got) - set(ref))
    return max(
        float((ref[name] - got[name]).norm() / ref[name].norm().clamp_min(1e-12)) for name in got
    )


def max_loss_diff(ref: list[float], got: list[float]) -> float:
    """Largest relative difference between two loss curves."""
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True))
