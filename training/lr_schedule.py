"""Learning-rate schedules: linear warmup from 0 to the peak, then a registered decay to min-lr.

The formulas are Megatron's `OptimizerParamScheduler.get_lr` (checked against megatron-core in
the tests). `lr_at(step)` is the rate used by the optimizer step that follows `step` completed
steps, so the very first step of a warmup runs at lr 0, as in Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

# decay_ratio in [0, 1] -> coefficient in [0, 1] applied to (max_lr - min_lr).
DECAY_COEFFICIENTS: dict[str, Callable[[float], float]] = {
    "constant": lambda ratio: 1.0,
    "linear": lambda ratio: 1.0 - ratio,
    "cosine": lambda ratio: 0.5 * (math.cos(math.pi * ratio) + 1.0),
}
LR_SCHEDULES = (*DECAY_COEFFICIENTS, "inverse-square-root")


def lr_at(
    step: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    decay_steps: int,
    decay_style: str,
    init_lr: float = 0.0,
) -> float:
    """The learning rate after `step` completed optimizer steps."""
    if decay_style not in LR_SCHEDULES:
        raise ValueError(
            f"--lr-decay-style {decay_style!r} is unknown; use one of {', '.join(LR_SCHEDULES)}"
        )
    if warmup_steps > 0 and step <= warmup_steps:
        return init_lr + (max_lr - init_lr) * step / warmup_steps
    if decay_style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    if decay_style == "inverse-square-root":
        lr = max_lr * math.sqrt(max(warmup_steps, 1)) / math.sqrt(max(step, 1))
        return max(min_lr, lr)
    span = decay_steps - warmup_steps
    ratio = (step - warmup_steps) / span if span > 0 else 1.0
    return min_lr + DECAY_COEFFICIENTS[decay_style](ratio) * (max_lr - min_lr)


class HasParamGroups(Protocol):
    """Anything with torch-optimizer-style `param_groups` (a torch optimizer or a wrapper)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class LRScheduler:
    """Sets `lr` on every param group of an optimizer from the step count (checkpointable).

    Param groups may carry `lr_mult` (a multiplier on the scheduled rate).
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        *,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
    ) -> None:
        if warmup_steps > decay_steps and decay_style != "constant":
            raise ValueError(
                f"warmup ({warmup_steps} iterations) is longer than the decay ({decay_steps}); "
                "shorten --lr-warmup-iters or lengthen --lr-decay-iters"
            )
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps, self.decay_style = (
            warmup_steps,
            decay_steps,
            decay_style,
        )
        self.num_steps = 0
        self._apply()

    def get_lr(self) -> float:
        """The rate for the next optimizer step."""
        return lr_at(
            self.num_steps,
            max_lr=self.max_lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            decay_style=self.decay_style,
        )

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def step(self, increment: int = 1) -> None:
        """Advance by `increment` completed optimizer steps and update the param groups."""
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (safe to save with weights_only loading)."""
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the step count; the schedule's shape comes from the current flags."""
        self.num_steps = int(state["num_steps"])
        self._apply()
