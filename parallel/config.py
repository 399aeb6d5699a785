"""The parallel library's typed configuration: what `parallel/` reads to lay out a training run.

This is what torchtitan's `ParallelismConfig` and Megatron's `ModelParallelConfig` are: the
degrees of each parallelism and the knobs of data parallelism, pipelining and recompute. Field
names are Megatron's (`tensor_model_parallel_size`), so a message can name the flag. A front end
maps its own settings onto it in one place (the training library: `TrainingConfig.parallel_config`)
and `build_dims`, `parallelize_model` and `apply_run_data_parallel` read only this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from models.model_states import PARAM_SWAP_BUFFER_COUNT
from parallel.offload_optimizer import OptimizerOffload


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout and data/pipeline/recompute settings of one training run."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in tensor-parallel regions."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage (interleaved schedules); None: one chunk per rank."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers of the first pipeline stage (None: an even split)."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers of the last pipeline stage (None: an even split)."""
    pipeline_schedule: str | None = None
    """Pipeline schedule name (`parallel.pipeline_schedules.SCHEDULES`; None: the default)."""
    overlap_grad_reduce: bool = False
    """Under pipelining: reduce a stage's gradients as soon as its last backward is done."""
    context_parallel_size: int = 1
    """Context-parallel (ring attention) size."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size (carved out of the data-parallel ranks)."""
    zero_stage: int = 0
    """0: DDP, 1: sharded optimizer state, 2: + sharded grads (FSDP2), 3: + sharded params."""
    hsdp: bool = False
    """Hybrid sharding: shard within groups, replicate across them (ZeRO-2/3)."""
    hsdp_shard_size: int = 0
    """Data-parallel ranks per HSDP shard group (0: the ranks of one node)."""
    cpu_offload: bool = False
    """Keep sharded parameters, grads and optimizer state on the CPU (ZeRO-3)."""
    optimizer_cpu_offload: bool = False
    """AdamW's states and step on the CPU (ZeRO-Offload), under any ZeRO stage."""
    optimizer_nvme_path: str | None = None
    """With optimizer_cpu_offload: hold the states in swap files in this directory (NVMe tier)."""
    param_nvme_path: str | None = None
    """With cpu_offload (ZeRO-3): hold the parameter shards in a swap file in this directory."""
    param_nvme_buffer_count: int = PARAM_SWAP_BUFFER_COUNT
    """Host buffers of the parameter tier: the group gathered and up to N-1 read ahead."""
    offload_pin_memory: bool = False
    """Pin the offload's host buffers (where an accelerator exists; a no-op on a CPU run)."""
    zero3_prefetch_layers: int = 0
    """ZeRO-3: layers whose parameters are all-gathered ahead of use (0: FSDP2's default)."""
    recompute_granularity: str | None = None
    """Activation recompute: "full", "selective" or None (off)."""
    recompute_method: str | None = None
    """Full recompute's layer grouping: "uniform" or "block"."""
    recompute_num_layers: int | None = None
    """Layers per recompute group (uniform) or recomputed layers per stage (block)."""
    compile: bool = False
    """torch.compile each decoder layer."""

    def model_parallel_size(self) -> int:
        """Ranks that share one model replica (tensor x pipeline x context)."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def optimizer_offload(self) -> OptimizerOffload | None:
        """The offloaded optimizer's tier (None: the optimizer steps where the parameters are)."""
        if not self.optimizer_cpu_offload:
            return None
        return OptimizerOffload(
            device="nvme" if self.optimizer_nvme_path else "cpu",
            nvme_path=self.optimizer_nvme_path,
            pin_memory=self.offload_pin_memory,
        )

    def parallel_config(self) -> ParallelConfig:
        """Itself (so a `ParallelConfig` is a `HasParallelConfig`)."""
        return self


class HasParallelConfig(Protocol):
    """A run's configuration that can say its parallel layout (a front end's config, or a
    `ParallelConfig` itself)."""

    def parallel_config(self) -> ParallelConfig:
        """The `ParallelConfig` of the run."""
        ...
