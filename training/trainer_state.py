"""The typed state of a running trainer: what setup, checkpointing and fine-tuning read and write.

`Trainer` (training/loop.py) is a `TrainerState`: it builds these fields in its constructor, and
the functions of `training.setup` and `training.finetune` take a `TrainerState`, so they depend on
the fields below and not on the loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from models.config import ModelConfig
from training.checkpoint import CheckpointManager, PathGuard
from training.config import TrainingConfig
from training.loss_scaler import NoLossScaler
from training.lr_schedule import LRScheduler
from training.precision import PrecisionOptimizer


@dataclass
class StepCounters:
    """Counters saved with every checkpoint (plain ints: safe to save and load)."""

    step: int = 0
    """Optimizer steps done."""
    consumed_samples: int = 0
    """Samples of the training data consumed (where the data stream resumes)."""
    skipped: int = 0
    """Steps skipped for an fp16 gradient overflow."""
    nan: int = 0
    """Steps whose loss or gradients were NaN/Inf."""

    def state_dict(self) -> dict[str, int]:
        """Plain ints."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        for key in ("step", "consumed_samples", "skipped", "nan"):
            setattr(self, key, int(state[key]))


@dataclass(eq=False, repr=False)  # a Trainer fills the fields in its own constructor
class TrainerState:
    """The live objects of one training run."""

    config: TrainingConfig
    """The run's settings."""
    model_config: ModelConfig
    """The `models` config of the network trained (written into every checkpoint)."""
    model: nn.Module
    """The model as trained: adapters added, parallelized and wrapped."""
    optimizer: PrecisionOptimizer
    """The optimizer with its precision handling (fp32 masters, clipping, overflow checks)."""
    scheduler: LRScheduler
    """The learning-rate schedule."""
    scaler: NoLossScaler
    """The loss scaler (dynamic under --fp16, a constant 1 otherwise)."""
    state: StepCounters
    """Step, consumed samples and skip counters."""
    checkpoints: CheckpointManager | None = None
    """The --save manager, made at the first save."""
    path_guard: PathGuard | None = None
    """Re-checks a checkpoint path right before it is written (the service's root check)."""
