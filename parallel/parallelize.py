"""Apply the configured model parallelism to a model and tell the loop how to feed it.

Order (DESIGN §1.5): tensor/sequence parallel → context parallel → recompute → data parallel
(DDP/FSDP2 over the data-parallel and context-parallel ranks together). Expert parallelism
(MoE experts split over ep data-parallel ranks) replaces DDP by `ExpertParallelGradSync`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.config import ModelConfig
from models.parallel_plan import check_model_split, format_plan
from parallel import pipeline
from parallel.compile import apply_compile
from parallel.config import ParallelConfig
from parallel.context_parallel import apply_context_parallel, shard_sequence
from parallel.data_parallel import apply_run_data_parallel, clip_grad_norm_, wrap_optimizer
from parallel.expert_parallel import (
    ExpertParallelGradSync,
    apply_expert_parallel,
    apply_moe_context_parallel,
    expert_parameters,
)
from parallel.grad_sync import GradSync
from parallel.parallel_dims import ParallelDims
from parallel.pipeline_schedules import default_schedule, get_schedule
from parallel.recompute import apply_recompute
from parallel.tensor_parallel import (
    apply_tensor_parallel,
    loss_parallel,
    tp_cross_entropy_sum,
)

log = logging.getLogger(__name__)
SEQUENCE_KEYS = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")


def check_model(
    dims: ParallelDims, model_config: ModelConfig, par: ParallelConfig | None = None
) -> None:
    """Validate the layout against the model's layers, heads, KV heads, FFN, vocabulary and
    experts (the layer split against `par`'s uneven first/last stage sizes, when given)."""
    uneven = par is not None and pipeline.layer_counts(par, model_config.num_layers) is not None
    check_model_split(
        model_config,
        tp=dims.tp,
        pp=dims.pp,
        virtual=dims.virtual_pp,
        even_layers=not uneven,
        sequence_parallel=dims.sequence_parallel,
    )
    window = getattr(model_config, "sliding_window", None)
    if window is not None and dims.cp > 1:
        raise ValueError(
            f"--context-parallel-size {dims.cp} with a sliding-window model (sliding_window="
            f"{window}) is not supported: ring attention has no window; use "
            "--context-parallel-size 1"
        )
    moe = model_config.moe
    if dims.ep > 1:
        if moe is None:
            raise ValueError(
                f"--expert-model-parallel-size {dims.ep} needs an MoE model (e.g. --model "
                "tiny-mixtral); this model has no experts"
            )
        if moe.num_experts % dims.ep:
            raise ValueError(
                f"--expert-model-parallel-size {dims.ep} must divide --num-experts "
                f"{moe.num_experts}; choose a size that divides it"
            )


@dataclass
class ModelParallelFeed:
    """How the loop feeds and scores a model-parallel replica.

    Every rank of a replica reads the same micro-batch; context-parallel ranks keep their
    sequence chunks. Sums over the whole job are made consistent by weights: a token count is
    shared by the tp·pp·cp ranks that read it, a loss sum by the tp ranks that computed it.
    """

    dims: ParallelDims

    @property
    def token_weight(self) -> float:
        """Multiplier of a rank's counted tokens before the job-wide sum."""
        return 1.0 / self.dims.model_parallel

    @property
    def loss_weight(self) -> float:
        """Multiplier of a rank's loss sum before the job-wide sum."""
        return 1.0 / self.dims.tp

    @property
    def grad_average_size(self) -> int:
        """Ranks whose gradients DDP/FSDP average (data x context parallel)."""
        return self.dims.dp * self.dims.cp

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's view of a micro-batch (explicit position ids; CP sequence chunks)."""
        batch = dict(batch)
        if "position_ids" not in batch and "segment_ids" not in batch:
            b, s = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(s).expand(b, s)
        if self.dims.cp > 1:
            rank = self.dims.coordinate("cp")
            for key in SEQUENCE_KEYS:
                if key in batch:
                    batch[key] = shard_sequence(batch[key], rank, self.dims.cp)
        return batch

    def loss_sum(self, logits_BSV: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed masked token loss (loss-parallel when the logits are vocabulary-sharded)."""
        return tp_cross_entropy_sum(logits_BSV, batch["labels"], batch["loss_mask"])

    def clip_pipeline_grads(
        self, model: nn.Module, max_norm: float, loss_scale: float
    ) -> float | None:
        """Under pipeline parallelism: clip to the norm over all stages; returns it (else None).

        First, under ZeRO 0/1 with TP/PP, it completes the data-parallel gradient averaging
        (`GradSync.finish`): the loop calls this after the last backward of every step.

        The precision optimizer measures the norm of the gradients it holds, which on a pipeline
        rank are one stage's; clipping here first (by the pipeline-wide norm, summed over the
        `pp` group) leaves it nothing to clip, and the step reports this norm instead.
        """
        runner = getattr(model, "runner", None)
        if runner is None:
            sync = getattr(model, "grad_sync", None)
            if sync is not None:
                sync.finish()
            return None
        runner.finish_gradients()

        group = self.dims.submesh("pp").get_group()
        limit = max_norm * loss_scale if max_norm > 0 else 0.0
        params = runner.norm_parameters(model)
        # The tied head copy is left out of the norm (the embedding counts it) but clipped alike:
        # an unclipped copy would take a larger step than the embedding it must stay equal to.
        copies = [runner.tied_copy] if runner.tied_copy is not None else []
        total = clip_grad_norm_(params, limit, extra_group=group, clip_also=copies)
        return float(total) / loss_scale

    def context(self) -> contextlib.AbstractContextManager[None]:
        """Wrap forward and backward: loss parallelism under TP."""
        return loss_parallel() if self.dims.tp > 1 else contextlib.nullcontext()


def parallelize_model(
    model: nn.Module,
    model_config: ModelConfig,
    par: ParallelConfig,
    dims: ParallelDims,
    param_dtype: torch.dtype,
) -> tuple[nn.Module, Any, Any]:
    """Apply PP, TP/SP, CP, recompute and DP to `model`: (model, grad-sync mesh, optimizer wrap).

    With pipeline parallelism the returned model is a `PipelineRankModel` whose `runner` runs the
    step; otherwise `model` itself, changed in place.
    """
    dims.virtual_pp = pipeline.virtual_chunks(
        model_config.num_layers, dims.pp, par.num_layers_per_virtual_pipeline_stage
    )
    check_model(dims, model_config, par)
    if dims.ep > 1:
        return _parallelize_expert_model(model, model_config, par, dims, param_dtype)
    mesh = dims.grad_sync_mesh()
    # DDP (`replicate`) does not compose with DTensor parameters or pipeline schedules: ZeRO 0/1
    # under TP/PP average gradients with `GradSync` instead (see parallel.grad_sync).
    own_sync = mesh is not None and (dims.tp > 1 or dims.pp > 1) and par.zero_stage < 2
    if par.hsdp:
        mesh = dims.hsdp_mesh()
    schedule = par.pipeline_schedule or default_schedule(dims.virtual_pp)
    v_shaped = get_schedule(schedule).v_shaped
    _check_tied_v_schedule(
        model_config, schedule, mesh is not None and not own_sync, par.zero_stage
    )
    chunks = (
        pipeline.build_chunks(
            model, dims, pipeline.layer_counts(par, model_config.num_layers), v_shaped=v_shaped
        )
        if dims.pp > 1
        else [(None, model)]
    )
    for _, chunk in chunks:
        _apply_within_replica(chunk, model_config, par, dims)
        if mesh is not None and not own_sync:
            apply_run_data_parallel(chunk, mesh, par, param_dtype)
    grad_sync = None
    if own_sync:
        assert mesh is not None
        grad_sync = GradSync([c for _, c in chunks], mesh.get_group())
    model = _with_grad_sync(model, chunks, dims, schedule, grad_sync, par)
    if mesh is None:
        return model, None, None
    model_ = model

    def wrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return wrap_optimizer(optimizer, model_, mesh, zero_stage=par.zero_stage)

    return model, mesh, wrap


def _parallelize_expert_model(
    model: nn.Module,
    model_config: ModelConfig,
    par: ParallelConfig,
    dims: ParallelDims,
    param_dtype: torch.dtype,
) -> tuple[nn.Module, Any, Any]:
    """Pipeline chunks, then expert parallelism over the `ep` axis of each, then TP (experts
    stay whole on the TP ranks: Megatron's expert-tensor-parallel size 1), CP and recompute,
    then data parallelism: expert gradients are summed over the ranks holding the same experts
    (and divided by dp) by `ExpertParallelGradSync` after the step's last backward (under PP,
    after the schedule); the other parameters are averaged over all dp ranks by FSDP2 (ZeRO 2/3,
    experts ignored) or by the same sync (ZeRO 0/1: no DDP wrapper, whose hooks would average the
    experts over ranks that hold different ones). Under ZeRO-1 the returned optimizer wrap
    shards the other parameters' state over all dp ranks and the experts' over the ranks
    holding the same experts. Without TP, PP or CP the caller applied recompute.

    The expert mesh has `pp` outermost, so a rank's `ep` group lies within its pipeline stage:
    the all-to-alls of a chunk's MoE layers run among ranks that run the same stage.
    """
    mesh = dims.expert_mesh()
    fsdp = par.zero_stage >= 2
    schedule = par.pipeline_schedule or default_schedule(dims.virtual_pp)
    _check_tied_v_schedule(model_config, schedule, fsdp, par.zero_stage)
    v_shaped = get_schedule(schedule).v_shaped
    # Chunks are cut from the whole model before any sharding (a deep copy per stage).
    chunks = (
        pipeline.build_chunks(
            model, dims, pipeline.layer_counts(par, model_config.num_layers), v_shaped=v_shaped
        )
        if dims.pp > 1
        else [(None, model)]
    )
    dp_mesh = dims.grad_sync_mesh()
    assert dp_mesh is not None, "ep > 1 implies a data-parallel size > 1"
    # HSDP: FSDP2 shards the non-expert parameters within `dp_shard` (x `cp`), replicates across.
    fsdp_mesh = dims.hsdp_mesh() if par.hsdp else dp_mesh
    for _, chunk in chunks:
        sharded = apply_expert_parallel(chunk, mesh["ep"])
        log.info("expert parallel (ep=%d): %d expert weights sharded", dims.ep, len(sharded))
        if dims.model_parallel > 1:
            _apply_within_replica(chunk, model_config, par, dims)
        if fsdp:
            apply_run_data_parallel(
                chunk, fsdp_mesh, par, param_dtype, ignored_params=expert_parameters(chunk)
            )
    # Ranks holding the same experts and feeding them different tokens: `dp_replicate` (HSDP)
    # and `edp`, `cp` (disjoint chunks of the same sequences) and, with sequence parallelism,
    # `tp` (each TP rank sends only its sequence shard's copies; without it every TP rank sends
    # the same ones). In mesh order, for the flattened group.
    axes = ("dp_replicate", "edp", "cp", *(("tp",) if dims.sequence_parallel else ()))
    same_experts = _ranks_along(mesh, axes)
    grad_sync = ExpertParallelGradSync(
        [c for _, c in chunks],
        dp_mesh.get_group(),
        None if same_experts is None else same_experts.get_group(),
        replicated=not fsdp,
    )
    model = _with_grad_sync(model, chunks, dims, schedule, grad_sync, par)
    if par.zero_stage != 1:
        return model, dp_mesh, None
    # ZeRO-1: the experts' optimizer state is split over the ranks holding the same experts.
    experts_mesh = _expert_state_mesh(mesh)
    param_meshes = {p: experts_mesh for _, c in chunks for p in expert_parameters(c)}
    model_ = model

    def wrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return wrap_optimizer(optimizer, model_, dp_mesh, zero_stage=1, param_meshes=param_meshes)

    return model, dp_mesh, wrap


def _expert_state_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over which ZeRO-1 shards the experts' optimizer state: the data-parallel
    ranks that hold the same experts (`edp`, and `cp`: the other parameters' state shards over
    dp x cp), from the expert mesh `mesh`. Not `tp`: like the rest of the model, the state is
    replicated over the tensor-parallel ranks, which run the same ep block."""
    ranks = _ranks_along(mesh, ("dp_replicate", "edp", "cp"))
    return mesh["edp"] if ranks is None else ranks


def _ranks_along(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh | None:
    """The 1-D mesh over `axes` of `mesh` that have more than one rank (several are flattened,
    in mesh order); None when all have one."""
    wide = tuple(axis for axis in axes if mesh[axis].size() > 1)
    if not wide:
        return None
    return mesh[wide[0]] if len(wide) == 1 else mesh[wide]._flatten("_".join(wide))


def _with_grad_sync(
    model: nn.Module,
    chunks: list,
    dims: ParallelDims,
    schedule: str,
    grad_sync: Any,
    par: ParallelConfig,
) -> nn.Module:
    """`model` carrying `grad_sync`: under PP a `PipelineRankModel` whose runner calls it per
    chunk, else `model` with it as a plain attribute (`ModelParallelFeed.clip_pipeline_grads`
    reads it back)."""
    if dims.pp == 1:
        model.grad_sync = grad_sync  # type: ignore[assignment]
        return model
    model_config = cast(ModelConfig, model.config)
    rank_model = pipeline.PipelineRankModel([c for _, c in chunks], model_config)
    rank_model.runner = pipeline.PipelineRunner(
        chunks,
        dims,
        schedule,
        next(rank_model.parameters()).device,
        grad_sync=grad_sync,
        overlap_grad_reduce=par.overlap_grad_reduce,
    )
    return rank_model


def _check_tied_v_schedule(
    model_config: ModelConfig, schedule: str, fsdp: bool, zero_stage: int
) -> None:
    """Refuse tied embeddings under FSDP2 with a V-shaped schedule (ValueError naming flags)."""
    if model_config.tie_word_embeddings and get_schedule(schedule).v_shaped and fsdp:
        raise ValueError(
            f"tied embeddings with --pipeline-schedule {schedule} share one parameter between "
            f"two FSDP-wrapped chunks of pipeline rank 0, which FSDP2 does not support; use "
            f"--zero-stage 0 or 1, or a looped schedule (got --zero-stage {zero_stage})"
        )


def _apply_within_replica(
    chunk: nn.Module, model_config: ModelConfig, par: ParallelConfig, dims: ParallelDims
) -> None:
    """TP/SP, then CP, recompute and compile on one model chunk (DESIGN §1.5's order, FSDP
    after)."""
    if dims.tp > 1:
        plan = apply_tensor_parallel(
            chunk, dims.submesh("tp"), model_config, sequence_parallel=dims.sequence_parallel
        )
        log.info("tensor-parallel plan (tp=%d):\n%s", dims.tp, _format(plan))
    if dims.cp > 1:
        cp_group = dims.submesh("cp").get_group()
        apply_context_parallel(chunk, cp_group)
        apply_moe_context_parallel(chunk, cp_group)
    if par.recompute_granularity is not None:
        chosen = apply_recompute(
            chunk, par.recompute_granularity, par.recompute_method, par.recompute_num_layers
        )
        log.info("recompute (%s): layers %s", par.recompute_granularity, chosen)
    if par.compile:
        apply_compile(chunk)


def _format(plan: dict[str, str]) -> str:
    return format_plan(plan) if plan else "(empty)"
