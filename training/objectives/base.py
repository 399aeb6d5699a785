"""What a training objective is: a loss over a micro-batch, normalised by a count the loop sums.

The loop scales each micro-batch's backward by the step's global count (every micro-batch, every
data-parallel rank) before any forward runs, so an objective says what it counts from the batch
alone (`count`: unmasked tokens for next-token losses, pairs for preference losses; a method, not
part of the output, because the loop needs it before the forward) and returns the summed loss
over exactly that (`compute`). The step's loss is then sum / count, whatever the
micro-batching, as docs/training.md describes for the token loss.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:  # a type only: parallelize pulls in the whole model-parallel stack
    from parallel.parallelize import ModelParallelFeed
    from parallel.pipeline import PipelineForward


@dataclass(frozen=True)
class ObjectiveOutput:
    """One micro-batch's result."""

    loss_sum: torch.Tensor
    """Summed loss over what `Objective.count` counts (a scalar; backward runs through it)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra sums to log (e.g. a preference objective's correct pairs): summed over the
    micro-batches and ranks and printed on the metrics line; every batch names the same keys."""


@dataclass(frozen=True)
class ForwardContext:
    """How the loop runs the model for this rank."""

    autocast: Callable[[], contextlib.AbstractContextManager[None]]
    """Enters the run's compute precision around the model's forward."""
    feed: ModelParallelFeed | None = None
    """The model-parallel feed (tensor/context/expert parallel), whose loss is vocabulary-parallel."""
    pipeline: PipelineForward | None = None
    """Under pipeline parallelism: the forward-only pass through this rank's stages (whose last
    stage holds the output), for what an objective scores outside the schedule."""


class Objective(ABC):
    """A training objective, registered in `training.objectives.OBJECTIVES` under its `name`."""

    name: ClassVar[str]
    """The string the CLI (--stage) and the config use."""
    pipeline_loss: ClassVar[bool] = False
    """True when the pipeline schedule's built-in loss (next-token cross entropy) is this one."""
    pipeline_scored: ClassVar[bool] = False
    """True when the pipeline's last stage scores this objective itself (`pipeline_inputs`,
    `pipeline_score`)."""
    metric_names: ClassVar[tuple[str, ...]] = ()
    """The metric sums `compute` returns (a pipeline rank without the last stage logs zeros)."""

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The network this objective trains, made from the registry model before any parallel
        wrapping, adapter or optimizer (a reward model swaps in a value head); default: as is."""
        return model

    def begin(self, model: nn.Module, step: int) -> None:
        """Called once before the first step this process runs, after any checkpoint load, with
        the (wrapped) model and the steps already done (DPO takes its reference here)."""
        del model, step  # nothing to set up for most objectives

    def prepare_step(
        self, model: nn.Module, micro: list[dict[str, torch.Tensor]], ctx: ForwardContext
    ) -> None:
        """Called with a step's micro-batches (as read, before any forward of the step; may add
        keys to them): DPO scores them under its reference here. Default: nothing."""
        del model, micro, ctx

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Token positions the micro-batch feeds the model (for the throughput line)."""
        return int(batch["input_ids"].numel())

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """The logged values from the metric sums of a logging window (default: the sums)."""
        return sums

    def pipeline_inputs(
        self, micro: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Under pipeline parallelism (`pipeline_scored`): the schedule's input ids and target
        for a step's micro-batches, one after another along the rows."""
        raise NotImplementedError(f"--stage {self.name} is not scored by the pipeline itself")

    def pipeline_score(
        self, output: torch.Tensor, target: torch.Tensor, ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Under pipeline parallelism: one micro-batch's result at the last stage, from the
        stage's output and that micro-batch's rows of `pipeline_inputs`' target."""
        raise NotImplementedError(f"--stage {self.name} is not scored by the pipeline itself")

    @abstractmethod
    def count(self, batch: dict[str, torch.Tensor]) -> float:
        """What the loss of `batch` is normalised by, read from the batch before any forward."""

    @abstractmethod
    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Run `model` on `batch` (already on the device and sharded) and score it."""
