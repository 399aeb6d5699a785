"""Per-device training memory: model states (ZeRO) and activations (Korthikanti et al. 2022).

Shapes: s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size, V vocab.

Model states count what Meshline's trainer holds (`models.model_states`, the counting
`meshline train --dry-run` reads off the built model): the elements each rank stores after
tensor/pipeline splitting and ZeRO sharding, times the bytes the run's precision mode keeps per
element (fp32: 4 + 4 + 8 for AdamW; master precision: 2 B params, 2 B + 4 B fp32 gradients, 4 B
master + 8 B moments; ZeRO-1 and ZeRO-2/3 under 16-bit train fp32 parameters, with
autocast or FSDP2's mixed-precision policy). ZeRO-1 chunks the optimizer state, ZeRO-2/3
(FSDP2) the parameters, gradients and state, over the data x context-parallel ranks; CPU offload
moves the ZeRO-3 states to host memory, the offloaded optimizer (`optimizer_offload`) the
optimizer's moments to host memory or NVMe swap files (`models.model_states`).

Activations per layer generalise Korthikanti et al.'s table to GQA, gated MLPs and optional
dropout; with GPT's shape (GeLU, F = 4h, K = H, dropout, 16-bit, no flash attention) they reduce
to the paper's s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes (`korthikanti_layer_bytes`). Under
1F1B, pipeline rank r holds the activations of (P - r) micro-batches; interleaving multiplies the
first rank's count by (1 + (P-1)/(P·V)) (Megatron's rule, applied to every rank here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from models.config import ModelConfig
from models.model_states import (
    OFFLOAD_OPTIMIZERS,
    OPTIMIZER_OFFLOAD_TIERS,
    OPTIMIZER_STATE_BYTES,
    StateBytes,
    param_swap_buffer_bytes,
    precision_mode,
    rank_elements,
    state_bytes,
)
from models.pipeline import StageRange, split_stages

PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def parse_bytes(text: str) -> int:
    """`80GiB`, `64 GB`, `1.5TiB` or a plain byte count → bytes (--device-memory)."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"--device-memory {text!r}: give a size such as 64GiB, 80GB or 1.5TiB")
    return int(float(match.group(1)) * _UNITS[unit])


RECOMPUTE = ("none", "selective", "full")


@dataclass
class TrainingLayout:
    """Parallel layout and run shape for a memory estimate."""

    tensor_parallel: int = 1
    """--tensor-model-parallel-size."""
    pipeline_parallel: int = 1
    """--pipeline-model-parallel-size."""
    data_parallel: int = 1
    """Data-parallel replicas (world size / (TP·PP))."""
    virtual_stages: int = 1
    """Virtual pipeline chunks per rank (interleaved 1F1B)."""
    zero_stage: int = 0
    """ZeRO stage: 0 none, 1 optimizer, 2 + gradients, 3 + parameters sharded over DP."""
    recompute: str = "none"
    """--recompute-granularity: none, selective (attention core) or full (whole layer)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (the latter two: mixed precision with fp32 master weights)."""
    micro_batch_size: int = 1
    """--micro-batch-size."""
    seq_length: int = 2048
    """--seq-length."""
    sequence_parallel: bool = False
    """--sequence-parallel: shard norm/dropout activations over TP too."""
    cpu_offload: bool = False
    """--cpu-offload: ZeRO-3's parameters, gradients and optimizer states live in host memory."""
    optimizer_offload: str | None = None
    """--optimizer-cpu-offload's tier: "cpu" (moments in host memory), "nvme" (in swap files)."""
    param_nvme: bool = False
    """--param-nvme-path (with --cpu-offload): ZeRO-3's parameter shards in a swap file."""
    staged_offload: bool = True
    """The offloaded step copies parameters and gradients through host buffers (an accelerator
    run; False where they are fp32 host tensors already: a CPU run)."""
    flash_attention: bool = True
    """Fused attention that never stores the s×s probabilities (SDPA, flash, NPU FA)."""
    context_parallel: int = 1
    """--context-parallel-size: each rank holds 1/cp of the sequence (and ZeRO shards over dp·cp)."""
    optimizer: str = "adamw"
    """--optimizer (its state bytes per element: models.model_states.OPTIMIZER_STATE_BYTES)."""
    release_fp32_grad: bool = False
    """--release-fp32-grad: no persistent fp32 gradient copy under master precision."""
    first_stage_layers: int | None = None
    """--decoder-first-pipeline-num-layers (uneven split; the other stages share the rest)."""
    last_stage_layers: int | None = None
    """--decoder-last-pipeline-num-layers."""
    fused_swiglu: bool = False
    """The packed SwiGLU saves only its [gate | up] input for backward, not act(gate) as well
    (the fused fp32 CPU training kernel: kernels.activation.trains_fused_swiglu)."""

    def stages(self, num_layers: int) -> list[StageRange]:
        """The pipeline stages of a model of `num_layers` under this layout."""
        return split_stages(
            num_layers,
            self.pipeline_parallel,
            self.virtual_stages,
            first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers,
        )

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel",
            "pipeline_parallel",
            "data_parallel",
            "virtual_stages",
            "context_parallel",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainingLayout.{name}={getattr(self, name)}: must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {self.zero_stage}: expected 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"--recompute-granularity {self.recompute!r}: expected one of {RECOMPUTE}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: expected one of {list(PRECISIONS)}")
        if self.micro_batch_size < 1 or self.seq_length < 1:
            raise ValueError("--micro-batch-size and --seq-length must be >= 1")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"--optimizer {self.optimizer!r}: expected one of {sorted(OPTIMIZER_STATE_BYTES)}"
            )
        if self.param_nvme and not (self.cpu_offload and self.optimizer_offload):
            raise ValueError(
                "parameters on NVMe need --cpu-offload (ZeRO-3) and --optimizer-cpu-offload"
            )
        if self.optimizer_offload is not None:
            if self.optimizer_offload not in OPTIMIZER_OFFLOAD_TIERS:
                raise ValueError(
                    f"optimizer offload tier {self.optimizer_offload!r}: expected one of "
                    f"{OPTIMIZER_OFFLOAD_TIERS}"
                )
            if self.optimizer not in OFFLOAD_OPTIMIZERS:
                raise ValueError(
                    f"--optimizer-cpu-offload steps AdamW on the CPU; --optimizer "
                    f"{self.optimizer} has no offloaded form: use one of {OFFLOAD_OPTIMIZERS}"
                )

    @property
    def mode(self) -> str:
        """The trainer's precision mode for this layout (models.model_states.precision_mode)."""
        return precision_mode(
            self.precision, self.zero_stage, self.data_parallel * self.context_parallel
        )


@dataclass(frozen=True)
class DeviceEstimate:
    """Bytes one device holds at its training peak."""

    kind: str
    """Which ranks this row describes ("all", "first stage", "middle stage", "last stage")."""
    parameters: int
    """Model parameters (device copy)."""
    gradients: int
    """Gradients."""
    optimizer: int
    """Optimizer states (incl. fp32 master weights under mixed precision)."""
    activations: int
    """Activations saved for backward at the 1F1B peak."""
    host: int
    """Bytes offloaded to host memory."""
    nvme: int = 0
    """Bytes in the NVMe tier's swap files."""

    @property
    def total(self) -> int:
        """Device bytes: model states plus activations."""
        return self.parameters + self.gradients + self.optimizer + self.activations


def korthikanti_layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    *,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes of one GPT layer per Korthikanti et al. (16-bit, with dropout)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention_scores = 0 if recompute == "selective" else 5 * a * s / h
    replicated = 10 / t if sequence_parallel else 10
    return s * b * h * (replicated + 24 / t + attention_scores / t)


def layer_activation_bytes(config: ModelConfig, layout: TrainingLayout) -> float:
    """Activation bytes one decoder layer saves for backward per micro-batch."""
    s, b, t = layout.seq_length, layout.micro_batch_size, layout.tensor_parallel
    h, a, f = config.hidden_size, config.num_attention_heads, config.ffn_hidden_size
    kv = config.kv_heads * config.head_dim
    p = PRECISIONS[layout.precision]
    sp = t if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return p * s * b * h / sp
    # Saved once per layer whatever the TP size (unless SP): both norm inputs, the qkv and
    # up/gate GEMM inputs, and the residual dropout masks (1 byte per element).
    replicated = 4 * p * s * b * h + (2 * s * b * h if config.hidden_dropout > 0 else 0)
    # Sharded over TP: q, k, v, the o_proj input and the MLP's intermediates.
    # Gated: the [gate | up] GEMM output, act(gate) and the product (the fused SwiGLU keeps no
    # act(gate)); GeLU: fc1 output and gelu's.
    mlp_intermediate = (3 if layout.fused_swiglu else 4) * f if config.gated else 2 * f
    sharded = p * s * b * (h + 2 * kv + h + mlp_intermediate)
    if layout.recompute == "none" and not layout.flash_attention:
        # softmax output; with attention dropout also its 1-byte mask and its output.
        per_score = p + ((1 + p) if config.attention_dropout > 0 else 0)
        sharded += per_score * a * s * s * b
    elif layout.flash_attention:
        sharded += 4 * a * s * b  # fp32 log-sum-exp per query row
    return replicated / sp + sharded / t


def stage_activation_bytes(
    config: ModelConfig, layout: TrainingLayout, stage_layers: int, first: bool, last: bool
) -> float:
    """Activation bytes of one pipeline stage for one micro-batch."""
    s, b, t = layout.seq_length, layout.micro_batch_size, layout.tensor_parallel
    h, v = config.hidden_size, config.vocab_size
    p = PRECISIONS[layout.precision]
    sp = t if layout.sequence_parallel else 1
    total = stage_layers * layer_activation_bytes(config, layout)
    if first and config.embedding_layernorm:
        total += p * s * b * h / sp
    if last:
        # final-norm input, head input, then logits and the fp32 log-softmax of the loss.
        total += 2 * p * s * b * h / sp + (p + 4) * s * b * v / t
    return total


def in_flight_microbatches(layout: TrainingLayout, pp_rank: int) -> float:
    """Micro-batches whose activations rank `pp_rank` holds at the 1F1B peak."""
    pp, vp = layout.pipeline_parallel, layout.virtual_stages
    count = float(pp - pp_rank)
    if vp > 1:
        count *= 1 + (pp - 1) / (pp * vp)
    return count


def model_shapes(config: ModelConfig) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every parameter of the model `config` builds (built on meta: free)."""
    # the network stack (kernels' backends, seconds to import) loads only for the meta model
    from models.transformer import build_model

    model = build_model(config, device="meta")
    return [(name, p.shape) for name, p in model.named_parameters()]


def rank_state_bytes(
    config: ModelConfig,
    layout: TrainingLayout,
    pp_rank: int,
    shard_index: int = 0,
    shapes: list[tuple[str, torch.Size]] | None = None,
) -> tuple[int, StateBytes]:
    """(parameter elements, state bytes) of the rank at `pp_rank` and data x context-parallel
    index `shard_index` — the counting `meshline train --dry-run` reads off the built model."""
    stages = layout.stages(config.num_layers)
    mine = [stage for stage in stages if stage.pp_rank == pp_rank]
    mode = layout.mode
    shards = layout.data_parallel * layout.context_parallel
    fsdp = mode == "fsdp" or (layout.zero_stage >= 2 and layout.precision == "fp32" and shards > 1)
    elements = rank_elements(
        shapes if shapes is not None else model_shapes(config),
        config,
        mine,
        tp=layout.tensor_parallel,
        sequence_parallel=layout.sequence_parallel,
        fsdp_ranks=shards if fsdp else 1,
        fsdp_index=shard_index,
        zero1_ranks=shards if layout.zero_stage == 1 else 1,
        zero1_index=shard_index,
    )
    return elements.parameters, state_bytes(
        elements.parameters,
        elements.optimizer,
        mode=mode,
        optimizer=layout.optimizer,
        release_fp32_grad=layout.release_fp32_grad,
        cpu_offload=layout.cpu_offload,
        optimizer_offload=layout.optimizer_offload,
        staged=layout.staged_offload,
        param_nvme=layout.param_nvme,
        param_buffer_bytes=param_swap_buffer_bytes(elements.largest_group)
        if layout.param_nvme
        else 0,
    )


def rank_activation_bytes(config: ModelConfig, layout: TrainingLayout, pp_rank: int) -> float:
    """Activation bytes held at the 1F1B peak by pipeline rank `pp_rank` (each context-parallel
    rank holds 1/cp of the sequence)."""
    stages = layout.stages(config.num_layers)
    per_micro = sum(
        stage_activation_bytes(
            config, layout, stage.num_layers, stage.has_embedding, stage.has_head
        )
        for stage in stages
        if stage.pp_rank == pp_rank
    )
    return per_micro * in_flight_microbatches(layout, pp_rank) / layout.context_parallel


def estimate(config: ModelConfig, layout: TrainingLayout) -> list[DeviceEstimate]:
    """Per-device estimates: one row per pipeline rank kind (first / middle / last), for the
    first data-parallel shard (under ZeRO the last shards may hold a little less)."""
    pp = layout.pipeline_parallel
    ranks = [0] if pp == 1 else ([0, 1, pp - 1] if pp > 2 else [0, pp - 1])
    kinds = {0: "first stage", pp - 1: "last stage"} if pp > 1 else {0: "all"}
    shapes = model_shapes(config)
    rows = []
    for rank in ranks:
        _, states = rank_state_bytes(config, layout, rank, shapes=shapes)
        rows.append(
            DeviceEstimate(
                kinds.get(rank, "middle stage"),
                states.parameters,
                states.gradients,
                states.optimizer,
                int(rank_activation_bytes(config, layout, rank)),
                states.host,
                states.nvme,
            )
        )
    return rows
