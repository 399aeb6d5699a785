"""The training library's typed configuration: the sections the loop reads, composed.

`TrainingConfig` holds what `training` itself needs (model choice, data, batch, optimizer,
precision, the run, parallelism, fine-tuning). A front end composes it: the trainer service's
`services.trainer.train_config.TrainConfig` adds Megatron's architecture flags and overrides
`model_config` / `attention_backend` to apply them. Field names are Megatron/ModelLink destination
names (`config.batch.micro_batch_size` is `--micro-batch-size`), so errors name the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Self

from models.model_states import OFFLOAD_OPTIMIZERS
from parallel.config import ParallelConfig
from parallel.parallel_dims import check_seq_length, check_world_size
from training.autotune_section import AutotuneSection
from training.config_sections import BatchSection, DataSection, ModelSection, OptimSection
from training.finetune import PeftSection, check
from training.fp8 import check_fp8
from training.lr_schedule import check_warmup
from training.model_config import registry_model_config
from training.objectives.layout import check_stage
from training.optimizer import open_nvme_path
from training.rl_sections import RLSection
from training.run_sections import ParallelSection, PrecisionSection, RunSection

if TYPE_CHECKING:
    from models.config import ModelConfig

__all__ = [
    "AutotuneSection",
    "BatchSection",
    "DataSection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "PeftSection",
    "PrecisionSection",
    "RLSection",
    "RunSection",
    "TrainingConfig",
]


@dataclass
class TrainingConfig:
    """Everything the training library reads for one run."""

    model: ModelSection = field(default_factory=ModelSection)
    """Network to train."""
    data: DataSection = field(default_factory=DataSection)
    """Token shards and tokenizer."""
    batch: BatchSection = field(default_factory=BatchSection)
    """Micro/global batch and ramp-up."""
    optim: OptimSection = field(default_factory=OptimSection)
    """Optimizer and LR schedule."""
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    """fp32/bf16/fp16 and loss scaling."""
    run: RunSection = field(default_factory=RunSection)
    """Length, eval, checkpoints, logging."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """Data and model parallelism, activation recompute."""
    peft: PeftSection = field(default_factory=PeftSection)
    """Parameter-efficient fine-tuning (LoRA, BitFit, prefix)."""
    rl: RLSection = field(default_factory=RLSection)
    """Online RL: rollouts, rewards, GRPO and PPO settings (--stage grpo|ppo)."""
    autotune: AutotuneSection = field(default_factory=AutotuneSection)
    """--autotune: measured trials of micro-batch, ZeRO stage and recompute before the run."""

    def model_config(self, tokenizer_vocab: int | None = None) -> ModelConfig:
        """The `models` config to train: --model from the registry with the shape flags, its
        vocabulary covering the tokenizer's (a front end with more model flags overrides this)."""
        return registry_model_config(self, tokenizer_vocab)

    def parallel_config(self) -> ParallelConfig:
        """The `parallel` library's view of --tensor-model-parallel-size and the other parallel
        flags: the one place the section maps onto `parallel.config.ParallelConfig` (same names)."""
        return ParallelConfig(
            **{f.name: getattr(self.parallel, f.name) for f in fields(ParallelConfig)}
        )

    def attention_backend(self) -> str | None:
        """The `kernels.attention` backend to force on every layer (None: the device's default)."""
        return None

    def validate(self, world_size: int = 1) -> Self:
        """Check the settings against each other and the job size; returns self."""
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        self.check_finite()
        dp = self._check_layout(world_size)
        self._check_batch_sizes(dp)
        self._check_model_and_data()
        warmup, decay = self.lr_warmup_iters(), self.lr_decay_iters()
        if warmup > decay and self.optim.lr_decay_style != "constant":
            raise ValueError(
                f"--lr-warmup-iters {warmup} is longer than --lr-decay-iters {decay} (default: "
                "--train-iters); shorten the warmup or lengthen the decay"
            )
        check_warmup(warmup, self.optim.lr_warmup_style, self.optim.lr_schedule_lag)
        self._check_profile(world_size)
        check(self)
        check_fp8(self)
        check_stage(self, world_size)
        shard = self.parallel.hsdp_shard_size
        if self.parallel.hsdp and shard and dp % shard:
            raise ValueError(
                f"--hsdp-shard-size {self.parallel.hsdp_shard_size} does not divide the data-parallel size {dp}"
            )
        return self

    def _check_layout(self, world_size: int) -> int:
        """The parallel sizes fit the job and the sequence; returns the data-parallel size."""
        par = self.parallel
        mp = par.model_parallel_size()
        check_world_size(
            world_size,
            tp=par.tensor_model_parallel_size,
            pp=par.pipeline_model_parallel_size,
            cp=par.context_parallel_size,
        )
        check_seq_length(self.model.seq_length, par.context_parallel_size)
        dp = self.dp_size(world_size)
        ep = self.parallel.expert_model_parallel_size
        if dp % ep:
            raise ValueError(
                f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp} "
                f"(world size {world_size} / tensor x pipeline x context parallel size {mp}): "
                "expert-parallel ranks are carved out of the data-parallel ranks"
            )
        check_optimizer_offload(par, self.optim.optimizer)
        return dp

    def _check_batch_sizes(self, dp: int) -> None:
        """The global batch and each ramp-up size split into micro-batches on `dp` ranks."""
        mbs = self.batch.micro_batch_size
        gbs = self.batch.global_batch_size
        if gbs is not None and gbs % (mbs * dp):
            raise ValueError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size "
                f"{dp}; use a multiple of {mbs * dp}"
            )
        if self.batch.rampup_batch_size is None:
            return
        if self.autotune.autotune:
            raise ValueError(
                "--autotune measures a few steps at one global batch; with "
                "--rampup-batch-size those steps are not the run's: drop one of them"
            )
        start, increment, _ = self.batch.rampup_batch_size
        if gbs is None:
            raise ValueError(
                "--rampup-batch-size needs --global-batch-size (the size it ramps up to)"
            )
        for flag, value in (("START", start), ("INCREMENT", increment)):
            if value % (mbs * dp):
                raise ValueError(
                    f"--rampup-batch-size {flag}={value} is not divisible by --micro-batch-size {mbs} x "
                    f"data-parallel size {dp}"
                )
        if (gbs - start) % increment:
            raise ValueError(
                f"--global-batch-size {gbs} minus --rampup-batch-size START {start} is not a multiple of "
                f"INCREMENT {increment}"
            )

    def _check_model_and_data(self) -> None:
        """A model is named or shaped, and exactly one data source (with its tokenizer) given."""
        if self.model.model is None and any(
            getattr(self.model, n) is None
            for n in ("num_layers", "hidden_size", "num_attention_heads")
        ):
            raise ValueError(
                "no model given: pass --model NAME (see models.registry.list_configs()) or all of "
                "--num-layers, --hidden-size and --num-attention-heads"
            )
        data = self.data
        has_data = bool(data.data_path or data.train_data_path)
        if not has_data and not data.mock_data:
            raise ValueError(
                "missing data: pass --data-path PREFIX [PREFIX ...] or --train-data-path PREFIX "
                "[PREFIX ...] (or --mock-data for random tokens)"
            )
        if has_data and data.mock_data:
            raise ValueError("--data-path / --train-data-path and --mock-data are exclusive")
        if has_data and data.tokenizer_type is None:
            raise ValueError(
                "--data-path needs --tokenizer-type (and --tokenizer-model or --tokenizer-name-or-path)"
            )

    def _check_profile(self, world_size: int) -> None:
        """With --profile, the profiled ranks exist and the first profiled step runs."""
        run = self.run
        if not run.profile:
            return
        outside = [r for r in run.profile_ranks if r >= world_size]
        if outside:
            raise ValueError(
                f"--profile-ranks {' '.join(map(str, outside))}: the job has ranks 0-"
                f"{world_size - 1}; pass ranks below {world_size}, or -1 for every rank"
            )
        if run.profile_step_start >= run.train_iters:
            raise ValueError(
                f"--profile-step-start {run.profile_step_start} is not before --train-iters "
                f"{run.train_iters}: no step would be profiled; lower it"
            )

    def check_finite(self) -> None:
        """Every number is finite (`--lr nan` or `--clip-grad inf` passes every range check)."""
        for section_field in fields(self):
            section = getattr(self, section_field.name)
            for f in fields(section):
                value = getattr(section, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(
                        f"--{f.name.replace('_', '-')} must be a finite number, got {value}"
                    )

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size of a job with `world_size` processes."""
        return world_size // self.parallel.model_parallel_size()

    def global_batch_size(self, world_size: int) -> int:
        """The configured global batch, defaulting to micro-batch x data-parallel size."""
        return self.batch.global_batch_size or self.batch.micro_batch_size * self.dp_size(
            world_size
        )

    def lr_decay_iters(self) -> int:
        """Decay length in iterations (defaults to --train-iters)."""
        return self.optim.lr_decay_iters or self.run.train_iters

    def lr_warmup_iters(self) -> int:
        """Warmup length in iterations, resolving --lr-warmup-fraction."""
        if self.optim.lr_warmup_fraction is not None:
            return int(self.optim.lr_warmup_fraction * self.lr_decay_iters())
        return self.optim.lr_warmup_iters


def check_optimizer_offload(par: ParallelSection, optimizer: str) -> None:
    """ValueError naming the flag when --optimizer-cpu-offload cannot apply."""
    if not par.optimizer_cpu_offload:
        return
    if optimizer not in OFFLOAD_OPTIMIZERS:
        raise ValueError(
            f"--optimizer-cpu-offload steps AdamW on the CPU; --optimizer {optimizer} has no "
            f"offloaded form: use --optimizer one of {OFFLOAD_OPTIMIZERS} or drop the offload"
        )
    if par.optimizer_nvme_path:
        open_nvme_path(par.optimizer_nvme_path, "--optimizer-nvme-path").close()
    if par.param_nvme_path:
        open_nvme_path(par.param_nvme_path, "--param-nvme-path").close()
