"""DeepSpeed's model-state estimates (`estimate_zero2/3_model_states_mem_needs*`), for a model.

DeepSpeed sizes a ZeRO run by two counts of the model — all parameters (a shared tensor once)
and the largest module's own parameters — and fixed bytes per parameter for its engine: 16-bit
parameters (2 B) and gradients (2 B), fp32 gradients, master parameters and Adam moments
(4 + 4 + 8 B), host buffers scaled by `additional_buffer_factor` (1.5), and at ZeRO-3 one
gathered layer of fp32 (4 B × the largest layer). `meshline estimate --deepspeed-estimate`
prints these rows so a DeepSpeed user sees the numbers they know for the same model; Meshline's
own rows (`models.memory`) count what Meshline's trainer holds, which differs by design (FSDP2
keeps fp32 shards and gathers 16-bit copies per layer; docs/decisions.md).

The formulas are DeepSpeed's (`deepspeed/runtime/zero/stage_1_and_2.py` and `stage3.py`,
0.19.8), written here with the same operation order: their float products are truncated with
`int()`, and a float product's rounding can depend on the order. `tests/models/test_deepspeed_estimate.py`
holds every row equal to DeepSpeed's own functions, and the counts to its `model_to_params`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BUFFER_FACTOR = 1.5
"""DeepSpeed's `additional_buffer_factor` default."""


@dataclass(frozen=True)
class ModelCounts:
    """The two counts of a model DeepSpeed's estimates read."""

    total_params: int
    """All parameter elements, a tensor shared by several modules (tied embeddings) once."""
    largest_layer_params: int
    """The most elements any one module holds directly (not in its children)."""


def model_counts(model: torch.nn.Module) -> ModelCounts:
    """DeepSpeed's `model_to_params` of stage 3: shared parameters counted once (DeepSpeed keys
    them by storage pointer, which needs real tensors; object identity is the same test for
    parameters and also works on the meta device), largest module by its own parameters."""
    unique = {id(p): p.numel() for p in model.parameters()}
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    return ModelCounts(sum(unique.values()), largest)


@dataclass(frozen=True)
class DeepSpeedRow:
    """One row of DeepSpeed's table: bytes per CPU (node) and per GPU for one offload choice."""

    cpu_bytes: int
    """Host memory per node."""
    gpu_bytes: int
    """Memory per device."""
    offload_optimizer: bool
    """`offload_optimizer.device: cpu`."""
    offload_param: bool = False
    """`offload_param.device: cpu` (ZeRO-3 only)."""
    zero_init: bool = True
    """Parameters created partitioned (`deepspeed.zero.Init`; ZeRO-3 only)."""

    def options(self, stage: int) -> str:
        """DeepSpeed's options column."""
        optimizer = "cpu" if self.offload_optimizer else "none"
        if stage == 2:
            return f"offload_optimizer={optimizer}"
        param = "cpu" if self.offload_param else "none"
        return (
            f"offload_param={param}, offload_optimizer={optimizer}, zero_init={int(self.zero_init)}"
        )


def zero2_bytes(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = DEFAULT_BUFFER_FACTOR,
) -> tuple[int, int]:
    """(host bytes per node, bytes per device) of ZeRO-2 (`estimate_zero2_model_states_mem_needs`)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        # The device keeps the 16-bit parameters; gradients, master copies and moments, times
        # one fp32 copy per device of the node at least, go to the host.
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2 B 16-bit params replicated; 2 + 4 B grads, 4 B master, 8 B moments sharded.
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_bytes(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = DEFAULT_BUFFER_FACTOR,
) -> tuple[int, int, int]:
    """(host bytes per node, bytes per device, gathered-layer bytes) of ZeRO-3
    (`estimate_zero3_model_states_mem_needs`)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = (
                    total_params
                    * max(4 * num_gpus_per_node, 18 * gpus_factor)
                    * additional_buffer_factor
                )
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = (
                    total_params
                    * max(4 * num_gpus_per_node, 16 * gpus_factor)
                    * additional_buffer_factor
                )
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def table(
    stage: int,
    counts: ModelCounts,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = DEFAULT_BUFFER_FACTOR,
) -> list[DeepSpeedRow]:
    """The rows `estimate_zero{stage}_model_states_mem_needs_all_cold` prints, in its order."""
    if stage == 2:
        return [
            DeepSpeedRow(
                *zero2_bytes(
                    counts.total_params,
                    num_gpus_per_node,
                    num_nodes,
                    offload,
                    additional_buffer_factor,
                ),
                offload_optimizer=offload,
            )
            for offload in (True, False)
        ]
    if stage != 3:
        raise ValueError(f"DeepSpeed estimates ZeRO-2 and ZeRO-3 only, not ZeRO-{stage}")
    rows = []
    for offload in (True, False):
        for offload_param in (True, False) if offload else (False,):
            for zero_init in (True, False):
                cpu, gpu, _ = zero3_bytes(
                    counts.total_params,
                    counts.largest_layer_params,
                    num_gpus_per_node,
                    num_nodes,
                    offload,
                    offload_param,
                    zero_init,
                    additional_buffer_factor,
                )
                rows.append(DeepSpeedRow(cpu, gpu, offload, offload_param, zero_init))
    return rows
