"""Learning-rate schedules: a warmup from 0 to the peak, then a registered decay to min-lr.

The formulas are Megatron's `OptimizerParamScheduler.get_lr` (checked against megatron-core in
the tests). `lr_at(step)` is the rate used by the optimizer step that follows `step` completed
steps, so the very first step of a warmup runs at lr 0, as in Megatron.

Two settings reproduce DeepSpeed's WarmupLR/WarmupDecayLR exactly (checked against DeepSpeed's
own classes in the tests): the "log" warmup style (the rate rises with log(step + 1) /
log(warmup), DeepSpeed's default `warmup_type`) and a lag of one step (DeepSpeed's scheduler
steps after the optimizer, starting from iteration -1, so optimizer step k runs at the
schedule's iteration k - 1; iterations before 0 run at iteration 0's rate).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # config_sections imports this module's bounds
    from training.config_sections import OptimSection

# decay_ratio in [0, 1] -> coefficient in [0, 1] applied to (max_lr - min_lr).
DECAY_COEFFICIENTS: dict[str, Callable[[float], float]] = {
    "constant": lambda ratio: 1.0,
    "linear": lambda ratio: 1.0 - ratio,
    "cosine": lambda ratio: 0.5 * (math.cos(math.pi * ratio) + 1.0),
}
LR_SCHEDULES = (*DECAY_COEFFICIENTS, "inverse-square-root")
WARMUP_STYLES = ("linear", "log")
MAX_SCHEDULE_LAG = 1_000_000
"""Bound on --lr-schedule-lag (a lag beyond any run's length is a typo)."""


def warmup_fraction(step: int, warmup_steps: int, style: str) -> float:
    """How far the warmup has come after `step` completed steps (0 <= step <= warmup_steps)."""
    if style == "log":
        # DeepSpeed's log warmup reaches the peak one step early: log(W) / log(W) at W - 1.
        if step >= warmup_steps:
            return 1.0
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


def check_warmup(warmup_steps: int, style: str, lag: int) -> None:
    """The warmup style and lag are usable with this warmup length."""
    if style not in WARMUP_STYLES:
        raise ValueError(
            f"--lr-warmup-style {style!r} is unknown; use one of {', '.join(WARMUP_STYLES)}"
        )
    if style == "log" and warmup_steps == 1:
        raise ValueError(
            "--lr-warmup-style log needs --lr-warmup-iters 0 or >= 2 (log(1) = 0); got 1"
        )
    if not 0 <= lag <= MAX_SCHEDULE_LAG:
        raise ValueError(f"--lr-schedule-lag must be in [0, {MAX_SCHEDULE_LAG}], got {lag}")


def lr_at(
    step: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    decay_steps: int,
    decay_style: str,
    init_lr: float = 0.0,
    warmup_style: str = "linear",
    lag: int = 0,
    warmup_lag: int = 0,
) -> float:
    """The learning rate after `step` completed optimizer steps, the schedule `lag` steps behind
    and its warmup `warmup_lag` more (the decay keeping its place)."""
    if decay_style not in LR_SCHEDULES:
        raise ValueError(
            f"--lr-decay-style {decay_style!r} is unknown; use one of {', '.join(LR_SCHEDULES)}"
        )
    check_warmup(warmup_steps, warmup_style, lag)
    step = max(step - lag, 0)  # before the schedule starts: its first rate
    if warmup_steps > 0 and step <= warmup_steps:
        step = max(step - warmup_lag, 0)
        if warmup_style == "linear":  # Megatron's exact arithmetic
            return init_lr + (max_lr - init_lr) * step / warmup_steps
        return init_lr + (max_lr - init_lr) * warmup_fraction(step, warmup_steps, warmup_style)
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
        warmup_style: str = "linear",
        lag: int = 0,
        warmup_lag: int = 0,
    ) -> None:
        check_warmup(warmup_steps, warmup_style, lag)
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
        self.warmup_style, self.lag, self.warmup_lag = warmup_style, lag, warmup_lag
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
            warmup_style=self.warmup_style,
            lag=self.lag,
            warmup_lag=self.warmup_lag,
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
            "warmup_style": self.warmup_style,
            "lag": self.lag,
            "warmup_lag": self.warmup_lag,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the step count; the schedule's shape comes from the current flags.

        The warmup style and the lag say which rate a given step count means, so a resume that
        changes them would jump the rate mid-run: refused (checkpoints from before these
        settings were saved with the defaults, linear and 0).
        """
        saved = (
            str(state.get("warmup_style", "linear")),
            int(state.get("lag", 0)),
            int(state.get("warmup_lag", 0)),
        )
        if saved != (self.warmup_style, self.lag, self.warmup_lag):
            raise ValueError(
                f"the checkpoint's schedule ran with --lr-warmup-style {saved[0]} "
                f"--lr-schedule-lag {saved[1]} --lr-warmup-lag {saved[2]}, this run has "
                f"--lr-warmup-style {self.warmup_style} --lr-schedule-lag {self.lag} "
                f"--lr-warmup-lag {self.warmup_lag}; resume with the checkpoint's values"
            )
        self.num_steps = int(state["num_steps"])
        self._apply()


def scheduler_for(
    optimizer: HasParamGroups, optim: OptimSection, warmup_steps: int, decay_steps: int
) -> LRScheduler:
    """The schedule the --lr* flags of `optim` describe over `warmup_steps` and `decay_steps`
    (the run's resolved --lr-warmup-iters and --lr-decay-iters)."""
    return LRScheduler(
        optimizer,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        decay_style=optim.lr_decay_style,
        warmup_style=optim.lr_warmup_style,
        lag=optim.lr_schedule_lag,
        warmup_lag=optim.lr_warmup_lag,
    )
