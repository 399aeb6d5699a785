"""`meshline train … --dry-run --world-size N`: build every rank's part of a real-size layout.

The training command line is parsed and validated as for a real run. Then, for each rank that
is not identical to another by symmetry, this process joins a fake process group as that rank
(PyTorch's test backend: collectives return at once, no data moves), builds the model on the
meta device and runs the trainer's own setup on it — precision plan, `build_parallel` (TP/SP, PP
stages incl. virtual, CP, EP, ZeRO-1/2/3, recompute) and `build_training_optimizer` — then counts
what the rank holds. No weights are allocated: a 70B layout over 64 ranks takes seconds.

Ranks differ only by pipeline rank and, where ZeRO shards over them, by data/context-parallel
index; tensor-parallel and expert-parallel ranks hold equal shares (the layout checks enforce
divisibility), as do HSDP replicas. One rank of each class is built and reported for all.

Bytes: parameters and their gradients as the built model stores them (the fp32 gradient copies
of master precision included), optimizer state from the elements the built optimizer steps
(models.model_states' per-element rule, since states are created at the first step),
activations from the estimator's formula (`models.memory`; a meta build cannot measure them).
Offload moves bytes off the device columns as the run would (`models.model_states`):
`--cpu-offload` all of the rank's states to `host`; `--optimizer-cpu-offload` the optimizer's
moments to `host` (or, with `--optimizer-nvme-path`, to `nvme`: swap files) plus the offloaded
step's host buffers (the parameter and gradient staging ones only where this process's device
is not the CPU); `--param-nvme-path` the parameter shards from `host` to `nvme`, leaving its
--param-nvme-buffer-count buffers (each the rank's largest gather group) in `host`.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kernels import device
from kernels.activation import trains_fused_swiglu
from models import build_model
from models.config import ModelConfig
from models.memory import TrainingLayout, rank_activation_bytes
from models.model_states import (
    OPTIMIZER_STATE_BYTES,
    offload_buffer_bytes,
    param_group,
    param_swap_buffer_bytes,
)
from parallel import pipeline
from parallel.config import ParallelConfig
from parallel.parallel_dims import AXES, ParallelDims, build_dims
from training.config import TrainingConfig
from training.optimizer import build_training_optimizer
from training.precision import plan_precision
from training.setup import build_model_config, build_parallel


@dataclass(frozen=True)
class RankReport:
    """What one rank holds."""

    rank: int
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    parameters: int
    """Elements of the parameters this rank stores."""
    unique_parameters: int
    """Of those, the elements it adds to the model's count when all ranks' are summed (copies
    held by several ranks, and a tied head's embedding copy, counted once)."""
    bytes: dict[str, int]


def _coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    coords = {}
    for axis in reversed(AXES):
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return coords


def _rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * sizes[axis] + coords[axis]
    return rank


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build_ranks(
    config: TrainingConfig, dims: ParallelDims, ranks: list[int]
) -> dict[int, dict[str, int]]:
    """`build_rank` for each of `ranks`, each in a fresh child process.

    One process cannot simply build rank after rank: DTensor's caches and meshes outlive
    `destroy_process_group`, and the next rank's meshes (equal shape and names) would pick up
    the previous rank's, whose groups are gone. Children come from a forkserver — one
    single-threaded process that imported the trainer once — so each starts in milliseconds,
    and none is forked from a process with other threads (a plain fork of a server or a test
    runner can inherit a lock some other thread held, and hang).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["training.dry_run"])
    with context.Pool(processes=1, maxtasksperchild=1) as pool:
        return {r: pool.apply(build_rank, (config, dims, r)) for r in ranks}


def _on_axis(p: torch.Tensor, axis: str, sharded: bool = False) -> bool:
    """Whether `p` is a DTensor over mesh axis `axis` (and, with `sharded`, split along it)."""
    if not isinstance(p, DTensor) or axis not in (p.device_mesh.mesh_dim_names or ()):
        return False
    if not sharded:
        return True
    index = (p.device_mesh.mesh_dim_names or ()).index(axis)
    return not p.placements[index].is_replicate()


def _holds_first_stage(
    config: TrainingConfig, model_config: ModelConfig, rank: int, dims: ParallelDims
) -> bool:
    pp_rank = _coordinates(rank, _axis_sizes(dims))["pp"]
    layout = _layout(config, dims.world_size)
    stages = layout.stages(model_config.num_layers)
    return any(s.has_embedding for s in stages if s.pp_rank == pp_rank)


def _axis_sizes(dims: ParallelDims) -> dict[str, int]:
    """Sizes of the mesh axes, outermost first (parallel.parallel_dims.AXES)."""
    return {axis: getattr(dims, axis) for axis in AXES}


def unique_elements(counts: dict[str, int], coords: dict[str, int], config: TrainingConfig) -> int:
    """Elements rank `coords` adds to the model's total when all ranks' are summed: copies held
    alike by several ranks (replicated over tp, over data/context-parallel ranks, a tied head's
    copy of the embedding) are counted once."""
    par = config.parallel
    fsdp = par.zero_stage >= 2
    ep = par.expert_model_parallel_size
    dense = counts["parameters"] - counts["experts"]
    experts = counts["experts"]
    if coords["tp"] != 0:
        dense -= counts["tp_replicated"]
        experts -= counts["experts_tp_replicated"]
    first_replica = coords["dp_replicate"] == 0 and (
        fsdp or (coords["dp_shard"] == 0 and coords["cp"] == 0)
    )
    expert_owner = coords["dp_replicate"] == 0 and coords["cp"] == 0 and coords["dp_shard"] < ep
    return (dense - counts["tied_copy"] if first_replica else 0) + (experts if expert_owner else 0)


def build_rank(config: TrainingConfig, dims: ParallelDims, rank: int) -> dict[str, int]:
    """Join a fake group as `rank`, build its model and optimizer on meta, count its states."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = dims.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        par = config.parallel
        plan = plan_precision(
            config.precision, par.zero_stage, config.dp_size(world_size) * par.context_parallel_size
        )
        model_config = build_model_config(config)
        meta_model: torch.nn.Module = build_model(model_config, device="meta")
        model, _, wrap = build_parallel(meta_model.to(plan.model_dtype), config, plan, dims)
        optimizer = build_training_optimizer(model, config.optim, plan, wrap_inner=wrap)
        params = list(model.parameters())
        parameters = sum(_local(p).numel() for p in params)
        kinds = {"tp_replicated": 0, "experts": 0, "experts_tp_replicated": 0}
        for p in params:
            expert = _on_axis(p, "ep")
            if not _on_axis(p, "tp", sharded=True):
                kinds["experts_tp_replicated" if expert else "tp_replicated"] += _local(p).numel()
            if expert:
                kinds["experts"] += _local(p).numel()
        tied_copy = 0
        if model_config.tie_word_embeddings:
            named = dict(model.named_parameters())
            if "embed_tokens.weight" in named and not _holds_first_stage(
                config, model_config, rank, dims
            ):
                tied_copy = _local(named["embed_tokens.weight"]).numel()
        param_bytes = sum(_local(p).numel() * p.element_size() for p in params)
        groups: dict[str, int] = {}
        for name, p in model.named_parameters():
            groups[param_group(name)] = groups.get(param_group(name), 0) + _local(p).numel()
        grad_bytes = param_bytes
        inner = getattr(optimizer, "inner", optimizer)
        slots = getattr(inner, "slots", None)
        state_elements = (
            sum(slot.shard.numel() for slot in slots)
            if slots is not None
            else sum(_local(p).numel() for g in inner.param_groups for p in g["params"])
        )
        if plan.mode == "master":
            # fp32 master copies; and the persistent fp32 gradient buffer unless released.
            masters = sum(_local(m).numel() for m in optimizer.master_params)
            master_bytes = 4 * masters
            if not plan.release_fp32_grad:
                grad_bytes += 4 * masters
        else:
            master_bytes = 0
        per_state = OPTIMIZER_STATE_BYTES[config.optim.optimizer]
        if config.optim.optimizer == "sgd" and config.optim.sgd_momentum == 0:
            per_state = 0
        return {
            "parameters": parameters,
            **kinds,
            "tied_copy": tied_copy,
            "param_bytes": param_bytes,
            "grad_bytes": grad_bytes,
            "optimizer_bytes": per_state * state_elements + master_bytes,
            "moment_bytes": per_state * state_elements,
            "largest_group": max(groups.values(), default=0),
        }
    finally:
        dist.destroy_process_group()


def _layout(config: TrainingConfig, world_size: int) -> TrainingLayout:
    """The estimator's view of this run (for activations)."""
    par = config.parallel
    precision = config.precision.dtype_name
    model_config = _model_config(config)
    return TrainingLayout(
        tensor_parallel=par.tensor_model_parallel_size,
        pipeline_parallel=par.pipeline_model_parallel_size,
        data_parallel=config.dp_size(world_size),
        virtual_stages=pipeline.virtual_chunks(
            model_config.num_layers,
            par.pipeline_model_parallel_size,
            par.num_layers_per_virtual_pipeline_stage,
        ),
        context_parallel=par.context_parallel_size,
        zero_stage=par.zero_stage,
        recompute=par.recompute_granularity or "none",
        precision=precision,
        micro_batch_size=config.batch.micro_batch_size,
        seq_length=config.model.seq_length,
        sequence_parallel=par.sequence_parallel,
        cpu_offload=par.cpu_offload,
        optimizer_offload=config.parallel_config().optimizer_offload().device
        if par.optimizer_cpu_offload
        else None,
        param_nvme=par.param_nvme_path is not None,
        staged_offload=device.current().type != "cpu",
        optimizer=config.optim.optimizer,
        release_fp32_grad=config.precision.release_fp32_grad,
        # The fused CPU SwiGLU runs eagerly; under --compile inductor decides what is saved.
        fused_swiglu=model_config.gated
        and model_config.fused_gate_up
        and not par.compile
        and trains_fused_swiglu(device.current().type, precision),
        first_stage_layers=par.decoder_first_pipeline_num_layers,
        last_stage_layers=par.decoder_last_pipeline_num_layers,
    )


def _model_config(config: TrainingConfig) -> ModelConfig:
    return build_model_config(config)


def representatives(config: TrainingConfig, dims: ParallelDims) -> dict[int, int]:
    """Every rank → the rank built for it (same pipeline rank and ZeRO shard index)."""
    zero = config.parallel.zero_stage
    sizes = _axis_sizes(dims)
    mapping = {}
    for rank in range(dims.world_size):
        coords = _coordinates(rank, sizes)
        coords["tp"] = 0
        if zero == 0:
            coords.update(dp_replicate=0, dp_shard=0, cp=0)
        elif zero >= 2:
            coords["dp_replicate"] = 0  # FSDP2 shards within dp_shard x cp, replicas alike
        mapping[rank] = _rank_of(coords, sizes)
    return mapping


def dry_run(
    config: TrainingConfig,
    world_size: int,
    device_memory: int | None,
    local_world_size: int | None = None,
) -> dict[str, Any]:
    """The report: per-rank parameters and bytes, the layout, whether it fits.

    `local_world_size` is the launcher's --nproc-per-node: without --hsdp-shard-size, HSDP
    shards within a node, as in the launched run (`parallel.parallel_dims.build_dims`).
    """
    check_world_size(world_size)
    config.validate(world_size)
    par = config.parallel
    dims = build_dims(config, world_size, local_world_size)
    mapping = representatives(config, dims)
    built = build_ranks(config, dims, sorted(set(mapping.values())))
    layout = _layout(config, world_size)
    model_config = _model_config(config)
    sizes = _axis_sizes(dims)
    ep = par.expert_model_parallel_size
    ranks = []
    for rank in range(world_size):
        coords = _coordinates(rank, sizes)
        counts = built[mapping[rank]]
        activations = int(rank_activation_bytes(model_config, layout, coords["pp"]))
        by_kind = {
            "parameters": counts["param_bytes"],
            "gradients": counts["grad_bytes"],
            "optimizer": counts["optimizer_bytes"],
            "activations": activations,
        }
        offload_bytes(
            by_kind, counts["moment_bytes"], config.parallel_config(), counts["largest_group"]
        )
        by_kind["total"] = sum(v for k, v in by_kind.items() if k not in ("host", "nvme"))
        dp_index = coords["dp_replicate"] * sizes["dp_shard"] + coords["dp_shard"]
        unique = unique_elements(counts, coords, config)
        ranks.append(
            RankReport(
                rank=rank,
                tp=coords["tp"],
                pp=coords["pp"],
                dp=dp_index,
                cp=coords["cp"],
                ep=coords["dp_shard"] % ep,
                parameters=counts["parameters"],
                unique_parameters=unique,
                bytes=by_kind,
            )
        )
    peak = max(r.bytes["total"] for r in ranks)
    return {
        "world_size": world_size,
        "layout": {
            "model": config.model.model,
            "tp": par.tensor_model_parallel_size,
            "pp": par.pipeline_model_parallel_size,
            "virtual_pp": layout.virtual_stages,
            "dp": config.dp_size(world_size),
            "dp_replicate": sizes["dp_replicate"],
            "cp": par.context_parallel_size,
            "ep": ep,
            "zero_stage": par.zero_stage,
            "sequence_parallel": par.sequence_parallel,
            "precision": layout.precision,
            "recompute": layout.recompute,
            "micro_batch_size": config.batch.micro_batch_size,
            "seq_length": config.model.seq_length,
            "ranks_built": len(built),
        },
        "ranks": [asdict(r) for r in ranks],
        "fits": {
            "device_memory_bytes": device_memory,
            "peak_rank_bytes": peak,
            "ok": None if device_memory is None else peak <= device_memory,
        },
    }


def offload_bytes(
    by_kind: dict[str, int], moment_bytes: int, par: ParallelConfig, largest_group: int = 0
) -> None:
    """Move the offloaded bytes of one rank from its device columns to `host` and `nvme`, as
    the run places them (the counting of `models.model_states.state_bytes`); `largest_group`
    is the elements of its largest gather group (the parameter tier's buffer)."""
    host = nvme = 0
    offload = par.optimizer_offload()
    if offload is not None:
        by_kind["optimizer"] -= moment_bytes
        if offload.device == "nvme":
            nvme = moment_bytes
        else:
            host = moment_bytes
        # --cpu-offload's fp32 host shards are stepped in place; elsewhere parameters and
        # gradients are staged unless they already are fp32 host tensors (a CPU run).
        staged = device.current().type != "cpu" and not par.cpu_offload
        host += offload_buffer_bytes(
            offload.device, staged, offload.buffer_numel, offload.buffer_count
        )
    if par.cpu_offload:
        host += by_kind["parameters"] + by_kind["gradients"] + by_kind["optimizer"]
        if par.param_nvme_path:  # the shards in a swap file, gathered through host buffers
            host -= by_kind["parameters"]
            nvme += by_kind["parameters"]
            host += param_swap_buffer_bytes(largest_group, par.param_nvme_buffer_count)
        by_kind.update(parameters=0, gradients=0, optimizer=0)
    if host or nvme:
        by_kind.update(host=host, nvme=nvme)


def format_table(report: dict[str, Any]) -> str:
    """One line per distinct rank class (GiB), as printed by the CLI."""
    gib = 2**30
    head = f"{'ranks':<18}{'tp':>4}{'pp':>4}{'dp':>4}{'params':>16}{'param':>9}{'grad':>9}"
    head += f"{'optim':>9}{'activ':>9}{'total':>9}{'host':>9}{'nvme':>9}"
    lines = [head, "-" * len(head)]
    groups: dict[tuple, list[int]] = {}
    for r in report["ranks"]:
        key = (r["pp"], r["dp"] if report["layout"]["zero_stage"] else 0, tuple(r["bytes"].items()))
        groups.setdefault(key, []).append(r["rank"])
    for (_, _, items), members in groups.items():
        first = report["ranks"][members[0]]
        b = dict(items)
        label = (
            f"{members[0]}"
            if len(members) == 1
            else f"{members[0]}..{members[-1]} ({len(members)})"
        )
        lines.append(
            f"{label:<18}{first['tp']:>4}{first['pp']:>4}{first['dp']:>4}{first['parameters']:>16,}"
            + "".join(
                f"{b.get(k, 0) / gib:>9.2f}"
                for k in (
                    "parameters",
                    "gradients",
                    "optimizer",
                    "activations",
                    "total",
                    "host",
                    "nvme",
                )
            )
        )
    return "\n".join(lines)


MAX_WORLD_SIZE = 65_536
"""Ranks a dry run simulates at most: its report has one entry per rank (memory grows with it)."""


def check_world_size(world_size: int | None) -> int:
    """The --world-size of a dry run (required, positive, at most `MAX_WORLD_SIZE`)."""
    if world_size is None or world_size < 1:
        raise ValueError("--dry-run needs --world-size N (the number of ranks to simulate)")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"--world-size {world_size}: a dry run simulates at most {MAX_WORLD_SIZE} ranks (it "
            "reports every rank, so memory grows with N); check a smaller job of the same "
            "parallel layout"
        )
    return world_size
