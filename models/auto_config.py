"""`meshline estimate --auto`: the parallel layouts that fit, ranked by a step-time cost model.

Candidates: every TP size that divides the heads, FFN and vocabulary (at most one node's
devices: TP traffic needs the intra-node links), every PP size that divides the layers (with 1 or
2 virtual chunks), data parallel over the rest, ZeRO 0/1/2/3, recompute none/selective/full and
micro-batches that divide the per-replica batch. A layout fits when the largest per-device
estimate (`models.memory`, the counting the dry run checks) is within the device memory.

Cost model (seconds per step; a ranking, not a prediction):
- compute: FLOPs of the step (6N + 12·L·H·Q·T per token; ×4/3 under full recompute, which
  reruns the forward; +5% for selective) over world × peak × `efficiency`;
- tensor parallel: 4 all-reduces of s·b·h activations per layer and micro-batch (2 forward,
  2 backward), 2·(t−1)/t of the bytes each, over the intra-node bandwidth;
- data parallel: the gradient all-reduce, 2·(d−1)/d of the replica's gradient bytes (ZeRO-1
  the same as a reduce-scatter + all-gather, ZeRO-3 1.5× for the extra parameter all-gather),
  over the inter-node bandwidth when the replicas span nodes, half of it overlapped with backward;
- pipeline: the 1F1B bubble, (p−1)/(m·v) of the compute for m micro-batches and v virtual
  chunks, plus one activation send per stage boundary and micro-batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from models.accounting import flops_per_token
from models.config import ModelConfig
from models.memory import TrainingLayout, model_shapes, rank_activation_bytes, rank_state_bytes

RECOMPUTE_FLOPS = {"none": 1.0, "selective": 1.05, "full": 4 / 3}


@dataclass(frozen=True)
class Hardware:
    """The machine the layouts are ranked for."""

    device_memory: int
    """Bytes of memory per device."""
    devices_per_node: int = 8
    """Devices sharing the fast intra-node links (TP stays within a node)."""
    peak_tflops: float = 989.0
    """Dense 16-bit peak of one device (kernels.peak_flops has the table)."""
    efficiency: float = 0.5
    """Fraction of the peak the model's matmuls reach (MFU of a communication-free step)."""
    intra_node_gbps: float = 450.0
    """Intra-node bandwidth per device, GB/s (NVLink / HCCS)."""
    inter_node_gbps: float = 50.0
    """Inter-node bandwidth per device, GB/s (400 Gb/s InfiniBand / RoCE)."""


@dataclass(frozen=True)
class Candidate:
    """One layout that fits, with its estimated peak memory and step time."""

    layout: TrainingLayout
    global_batch_size: int
    peak_bytes: int
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Estimated training throughput of the whole job."""
        return self.global_batch_size * self.layout.seq_length / self.step_seconds


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def peak_bytes(config: ModelConfig, layout: TrainingLayout, shapes: list) -> int:
    """The largest per-device total over the pipeline ranks (first data-parallel shard)."""
    peak = 0
    for pp_rank in range(layout.pipeline_parallel):
        _, states = rank_state_bytes(config, layout, pp_rank, shapes=shapes)
        activations = rank_activation_bytes(config, layout, pp_rank)
        peak = max(peak, states.parameters + states.gradients + states.optimizer + int(activations))
    return peak


def step_seconds(
    config: ModelConfig,
    layout: TrainingLayout,
    global_batch: int,
    hw: Hardware,
    shapes: list | None = None,
) -> float:
    """The cost model of the module doc."""
    t, p, d, v = (
        layout.tensor_parallel,
        layout.pipeline_parallel,
        layout.data_parallel,
        layout.virtual_stages,
    )
    world = t * p * d
    s, b = layout.seq_length, layout.micro_batch_size
    tokens = global_batch * s
    flops = flops_per_token(config, s) * tokens * RECOMPUTE_FLOPS[layout.recompute]
    compute = flops / (world * hw.peak_tflops * 1e12 * hw.efficiency)
    micro_batches = global_batch // (d * b)
    bytes_per_value = 4 if layout.precision == "fp32" else 2
    activation = s * b * config.hidden_size * bytes_per_value
    layers_per_rank = config.num_layers / p
    tp_comm = 0.0
    if t > 1:
        per_micro = 4 * layers_per_rank * 2 * (t - 1) / t * activation
        tp_comm = micro_batches * per_micro / (hw.intra_node_gbps * 1e9)
    dp_comm = 0.0
    if d > 1:
        unsharded = replace(layout, zero_stage=0, data_parallel=1)
        _, states = rank_state_bytes(config, unsharded, 0, shapes=shapes)
        grad_bytes = states.parameters  # one gradient per parameter, in the parameters' dtype
        volume = 2 * (d - 1) / d * grad_bytes * (1.5 if layout.zero_stage == 3 else 1.0)
        spans_nodes = world > hw.devices_per_node
        bandwidth = hw.inter_node_gbps if spans_nodes else hw.intra_node_gbps
        dp_comm = 0.5 * volume / (bandwidth * 1e9)
    bubble = compute * (p - 1) / (micro_batches * v) if p > 1 else 0.0
    pp_comm = 0.0
    if p > 1:
        pp_comm = 2 * micro_batches * activation / t / (hw.inter_node_gbps * 1e9)
    return compute + tp_comm + dp_comm + bubble + pp_comm


def candidates(
    config: ModelConfig,
    world_size: int,
    global_batch: int,
    seq_length: int,
    hw: Hardware,
    *,
    precision: str = "bf16",
) -> list[Candidate]:
    """Every fitting layout, fastest first."""
    shapes = model_shapes(config)
    found = []
    tp_sizes = [
        t
        for t in _divisors(world_size)
        if t <= hw.devices_per_node
        and config.num_attention_heads % t == 0
        and config.ffn_hidden_size % t == 0
        and config.vocab_size % t == 0
        and (config.kv_heads % t == 0 or t % config.kv_heads == 0)
    ]
    for t in tp_sizes:
        for p in _divisors(world_size // t):
            if config.num_layers % p:
                continue
            d = world_size // (t * p)
            if global_batch % d:
                continue
            per_replica = global_batch // d
            chunk_options = [1] + ([2] if p > 1 and (config.num_layers // p) % 2 == 0 else [])
            for v, zero, recompute, b in itertools.product(
                chunk_options, (0, 1, 2, 3), ("none", "selective", "full"), (1, 2, 4, 8)
            ):
                if per_replica % b or (zero and d == 1):
                    continue
                layout = TrainingLayout(
                    tensor_parallel=t,
                    pipeline_parallel=p,
                    data_parallel=d,
                    virtual_stages=v,
                    zero_stage=zero,
                    recompute=recompute,
                    precision=precision,
                    micro_batch_size=b,
                    seq_length=seq_length,
                    sequence_parallel=t > 1,
                )
                peak = peak_bytes(config, layout, shapes)
                if peak > hw.device_memory:
                    continue
                seconds = step_seconds(config, layout, global_batch, hw, shapes)
                found.append(Candidate(layout, global_batch, peak, seconds))
    return sorted(found, key=lambda c: c.step_seconds)


def command_line(
    model: str, num_layers: int, candidate: Candidate, world_size: int, devices_per_node: int
) -> str:
    """The `meshline train` command of a candidate (launch flags included)."""
    layout = candidate.layout
    nodes = max(1, world_size // devices_per_node)
    per_node = world_size // nodes
    parts = [
        "meshline train",
        f"--nproc-per-node {per_node}",
        *([f"--nnodes {nodes}"] if nodes > 1 else []),
        f"--model {model}",
        f"--tensor-model-parallel-size {layout.tensor_parallel}",
        f"--pipeline-model-parallel-size {layout.pipeline_parallel}",
    ]
    if layout.virtual_stages > 1:
        per_chunk = num_layers // (layout.pipeline_parallel * layout.virtual_stages)
        parts.append(f"--num-layers-per-virtual-pipeline-stage {per_chunk}")
    if layout.sequence_parallel:
        parts.append("--sequence-parallel")
    parts += [
        f"--zero-stage {layout.zero_stage}",
        f"--micro-batch-size {layout.micro_batch_size}",
        f"--global-batch-size {candidate.global_batch_size}",
        f"--seq-length {layout.seq_length}",
    ]
    if layout.recompute != "none":
        parts.append(f"--recompute-granularity {layout.recompute}")
    if layout.precision != "fp32":
        parts.append(f"--{layout.precision}")
    return " ".join(parts)
