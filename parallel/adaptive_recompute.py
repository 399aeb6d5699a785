"""Adaptive recompute: measure activation memory over the first steps, then recompute just
enough layers for a step to fit `--auto-recompute-device-size` MB (ModelLink's flags).

While profiling, a saved-tensor hook adds up the bytes autograd keeps for backward inside each
decoder layer (parameters excluded), and the device memory in use before each step is the static
part (weights, gradients, optimizer state). The predicted peak of a plan is

    static + Σ activations of layers kept + max activations of one recomputed layer

(a recomputed layer rebuilds its activations in backward, one layer at a time). Layers are
switched to full recompute, largest activations first, until the prediction fits; the plan is
logged. If even recomputing every layer does not fit, every layer recomputes and a warning says
by how much the budget is short.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import device
from parallel.recompute import wrap_layer

log = logging.getLogger(__name__)
MIN_PROFILING_STEPS = 5


@dataclass(frozen=True)
class RecomputePlan:
    """The outcome of profiling."""

    layers: list[int]
    """Global ids of the layers switched to full recompute."""
    predicted_peak: int
    """Predicted step peak in bytes with this plan."""
    budget: int
    """The budget in bytes."""


def choose_layers(activations: dict[int, int], static: int, budget: int) -> RecomputePlan:
    """Fewest layers to recompute (largest activations first) so the predicted peak fits."""
    chosen: list[int] = []
    kept = dict(activations)

    def peak() -> int:
        recompute = max((activations[i] for i in chosen), default=0)
        return static + sum(kept.values()) + recompute

    for layer_id in sorted(activations, key=lambda i: (-activations[i], i)):
        if peak() <= budget:
            break
        chosen.append(layer_id)
        kept.pop(layer_id)
    return RecomputePlan(sorted(chosen), peak(), budget)


class AdaptiveRecompute:
    """Profiles `layers` for `profiling_steps` steps, then applies a plan that fits `budget_mb`."""

    def __init__(self, layers: nn.ModuleDict, budget_mb: int, profiling_steps: int) -> None:
        if profiling_steps < MIN_PROFILING_STEPS:
            raise ValueError(
                f"--auto-recompute-profiling-step must be >= {MIN_PROFILING_STEPS}, "
                f"got {profiling_steps}"
            )
        if budget_mb <= 0:
            raise ValueError(f"--auto-recompute-device-size must be positive MB, got {budget_mb}")
        self.layers = layers
        self.budget = budget_mb * 2**20
        self.profiling_steps = profiling_steps
        self.activations: dict[int, int] = {int(k): 0 for k in layers}
        self.static = 0
        self.plan: RecomputePlan | None = None
        self.measured_peak: int | None = None
        """The first step's measured peak under the chosen plan (bytes; on CPU the process's
        lifetime peak resident set, which the OS does not reset between steps)."""
        self._checking = False
        self._handles = [h for key, layer in layers.items() for h in self._hook(int(key), layer)]

    def _hook(self, layer_id: int, layer: nn.Module) -> list[Any]:
        state: dict[str, Any] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not (t.is_leaf and t.requires_grad):
                state["bytes"] += t.numel() * t.element_size()
            return t

        def pre(_: nn.Module, __: Any) -> None:
            state["bytes"] = 0
            state["ctx"] = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
            state["ctx"].__enter__()

        def post(_: nn.Module, __: Any, ___: Any) -> None:
            state["ctx"].__exit__(None, None, None)
            # Per micro-batch; the largest seen is what a step must hold at once.
            self.activations[layer_id] = max(self.activations[layer_id], state["bytes"])

        return [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]

    def before_step(self) -> None:
        """Record the static memory (call before a step's first forward while profiling); before
        the first step under the plan, start a new peak window to measure that step."""
        if self.plan is None:
            self.static = max(self.static, device.memory_stats().allocated)
        elif self.measured_peak is None:
            device.current().reset_peak_memory_stats()
            self._checking = True

    def after_step(self, step: int, log_fn: Callable[[str], None] | None = None) -> None:
        """After the last profiling step: choose, apply and log the plan; after the next one,
        check the plan against that step's measured peak."""
        if self.plan is not None and self._checking:
            self._check_measured(log_fn)
            return
        if self.plan is not None or step < self.profiling_steps:
            return
        for handle in self._handles:
            handle.remove()
        self.plan = choose_layers(self.activations, self.static, self.budget)
        for layer_id in self.plan.layers:
            wrap_layer(self.layers[str(layer_id)], "full")
        message = (
            f"adaptive recompute after {step} profiled steps: recompute layers "
            f"{self.plan.layers or 'none'}; predicted peak {self.plan.predicted_peak / 2**20:.1f} "
            f"MiB (static {self.static / 2**20:.1f} MiB + activations) for a budget of "
            f"{self.budget / 2**20:.0f} MiB"
        )
        if self.plan.predicted_peak > self.budget:
            log.warning("%s — over budget even with every layer recomputed", message)
        else:
            log.info("%s", message)
        if log_fn is not None:
            log_fn(message)

    def _check_measured(self, log_fn: Callable[[str], None] | None) -> None:
        """The plan's step measured: its peak beside the prediction, a warning over budget."""
        assert self.plan is not None
        self._checking = False
        self.measured_peak = device.memory_stats().peak
        message = (
            f"adaptive recompute: measured peak {self.measured_peak / 2**20:.1f} MiB in the "
            f"first step with layers {self.plan.layers or 'none'} recomputed (predicted "
            f"{self.plan.predicted_peak / 2**20:.1f} MiB, budget {self.budget / 2**20:.0f} MiB)"
        )
        if self.measured_peak > self.budget:
            log.warning(
                "%s — over --auto-recompute-device-size: raise it, or recompute more (e.g. "
                "--recompute-granularity full)",
                message,
            )
        else:
            log.info("%s", message)
        if log_fn is not None:
            log_fn(message)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
