"""Pipeline parallelism: this rank's stage chunks, `torch.distributed.pipelining` schedules, and
the runner the training loop calls for a whole step's micro-batches.

Shapes: B micro-batch, S sequence, E hidden, V vocab.

Stages come from `models.pipeline.split_stages` (even or uneven layer ranges; stage c·P + r is
virtual chunk c of pipeline rank r; embedding on the first stage, norm and head on the last).
Each chunk is a pruned `CausalLM` that keeps global names; `PipelineRankModel` gathers a rank's
chunks under those names for the optimizer and checkpoints (DCP lines them up across layouts).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward

from models.config import ModelConfig
from models.pipeline import build_stage, split_stages
from parallel.config import ParallelConfig
from parallel.pipeline_schedules import SCHEDULES, get_schedule
from parallel.tensor_parallel import tp_cross_entropy_sum
from parallel.tied_embeddings import EmbeddingGroup, share_on_rank


def stage_rank(stage_index: int, pp: int, v_shaped: bool) -> int:
    """Pipeline rank that runs `stage_index` (looped: index mod P; V: mirrored second half)."""
    if v_shaped and stage_index >= pp:
        return 2 * pp - 1 - stage_index
    return stage_index % pp


def layer_counts(par: ParallelConfig, num_layers: int) -> list[int] | None:
    """Per-stage layer counts of an uneven split (--decoder-first/last-pipeline-num-layers), or
    None for the even split; ValueError naming the flags when the rest cannot be even."""
    first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return None

    try:
        stages = split_stages(
            num_layers,
            par.pipeline_model_parallel_size,
            first_stage_layers=first,
            last_stage_layers=last,
        )
    except ValueError as exc:
        raise ValueError(
            f"--decoder-first-pipeline-num-layers {first} / --decoder-last-pipeline-num-layers "
            f"{last} with {num_layers} layers over --pipeline-model-parallel-size "
            f"{par.pipeline_model_parallel_size}: {exc}"
        ) from None
    return [stage.num_layers for stage in stages]


def virtual_chunks(num_layers: int, pp: int, layers_per_virtual_stage: int | None) -> int:
    """Chunks per pipeline rank from --num-layers-per-virtual-pipeline-stage (Megatron's rule)."""
    if layers_per_virtual_stage is None:
        return 1
    per_rank = num_layers // pp
    if num_layers % pp or per_rank % layers_per_virtual_stage:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} must divide the "
            f"layers per pipeline rank (num_layers={num_layers} / --pipeline-model-parallel-size "
            f"{pp} = {num_layers / pp:g})"
        )
    return per_rank // layers_per_virtual_stage


class PipelineRankModel(nn.Module):
    """A pipeline rank's chunks under their global names (for optimizers and checkpoints).

    It shares the chunks' modules; running happens through `PipelineRunner`, not `forward`.
    """

    def __init__(self, chunks: list[Any], config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict({k: m for c in chunks for k, m in c.layers.items()})
        owned = {}
        for name in ("embed_tokens", "embed_positions", "embed_layernorm", "norm", "lm_head"):
            owner = next((c for c in chunks if getattr(c, name, None) is not None), None)
            owned[name] = getattr(owner, name) if owner is not None else None
        if config.tie_word_embeddings and owned["embed_tokens"] is None and owned["lm_head"]:
            # The head copy answers to the embedding's global name too, as in the tied model
            # (state dict: both keys; parameters and optimizer state: `embed_tokens.weight`).
            owned["embed_tokens"] = _TiedWeight(owned["lm_head"].weight)
        for name, module in owned.items():
            setattr(self, name, module)
        self.chunks = chunks  # plain list: not registered twice
        self.runner: PipelineRunner | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Not callable: a pipeline rank runs micro-batches through `PipelineRunner.run`."""
        raise RuntimeError("a pipeline-parallel model runs through its PipelineRunner")


class _TiedWeight(nn.Module):
    """Holds the last stage's tied head copy under the name `embed_tokens.weight`."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def build_chunks(
    model: Any, dims: Any, layer_counts: list[int] | None = None, *, v_shaped: bool = False
) -> list:
    """(stage ranges, pruned CausalLM chunks) of this pipeline rank, cut from `model`."""
    config = model.config
    stages = split_stages(config.num_layers, dims.pp, dims.virtual_pp, layer_counts)
    if v_shaped and dims.virtual_pp != 2:
        raise ValueError(
            f"V-shaped pipeline schedules run 2 chunks per rank; set "
            f"--num-layers-per-virtual-pipeline-stage to num_layers / (2 x "
            f"--pipeline-model-parallel-size {dims.pp}) (got {dims.virtual_pp} chunks)"
        )
    rank = dims.coordinate("pp")
    mine = [s for s in stages if stage_rank(s.stage_index, dims.pp, v_shaped) == rank]
    chunks = [(stage, build_stage(copy.deepcopy(model), stage)) for stage in mine]
    if config.tie_word_embeddings:
        share_on_rank(chunks)
    return chunks


class _Stage(PipelineStage):
    """A `PipelineStage` that hands its gradients to data parallelism at its last backward.

    torch's stages keep FSDP2 from reducing during every backward and reduce a stage's
    gradients in one go afterwards (`perform_reduce_grad`: after the whole schedule for
    1F1B/GPipe, after the stage's last backward for the looped and V schedules). With
    `overlap` the last micro-batch's full backward runs with FSDP2's gradient sync on, so each
    layer's reduce-scatter is issued as soon as that layer's gradient is complete and overlaps
    the remaining backward (ModelLink's Fold3D); `on_last_backward` (ZeRO 0/1: launch the
    asynchronous all-reduce) is called once the stage's gradients are final.
    """

    def __init__(
        self,
        *args: Any,
        overlap: bool = False,
        on_last_backward: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.overlap = overlap
        self.on_last_backward = on_last_backward

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        """Run one backward; see the class doc for what the last one does differently."""
        if (
            self.overlap
            and last_backward
            and backward_type == "full"
            and isinstance(self.submod, FSDPModule)
        ):
            self.submod.set_is_last_backward(True)
            self.submod.set_reshard_after_backward(True)
            self.submod.set_requires_gradient_sync(True)
            grads = stage_backward(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
            )
            return grads, None
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if last_backward and backward_type != "input" and self.on_last_backward is not None:
            self.on_last_backward()
        return result


class ChunkGradSync(Protocol):
    """Data-parallel gradient reduction of a pipeline rank's chunks (`GradSync`, or
    `ExpertParallelGradSync` under expert parallelism)."""

    def start(self, chunk: int) -> None:
        """Launch chunk `chunk`'s reduction (after its last backward)."""

    def finish(self) -> None:
        """Launch what is left, wait, and write the reduced gradients back."""


class StageScore(Protocol):
    """How the last stage scores a micro-batch when the objective is not next-token cross
    entropy (`PipelineRunner.run_scored`)."""

    def __call__(
        self, output: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(summed loss, metric sums) of one micro-batch's output and target rows."""


class PipelineRunner:
    """Runs one step's micro-batches through the schedule; returns this rank's summed loss.

    `grad_sync` (ZeRO 0/1 with data parallelism, or expert parallelism) reduces the chunks'
    gradients; with `overlap_grad_reduce` each chunk's reduction starts right after its last
    backward.
    """

    def __init__(
        self,
        chunks: list[tuple[Any, nn.Module]],
        dims: Any,
        schedule: str,
        device: torch.device,
        *,
        grad_sync: ChunkGradSync | None = None,
        overlap_grad_reduce: bool = False,
    ) -> None:
        self.schedule = get_schedule(schedule)
        if len(chunks) > 1 and not self.schedule.multi_stage:
            multi = tuple(name for name, s in SCHEDULES.items() if s.multi_stage)
            raise ValueError(
                f"--pipeline-schedule {schedule} runs one stage per rank but virtual pipelining "
                f"gives {len(chunks)}; use one of {multi}"
            )
        self.group = dims.submesh("pp").get_group()
        self.pp = dims.pp
        num_stages = dims.pp * dims.virtual_pp
        self.stages = [
            _Stage(
                chunk,
                stage.stage_index,
                num_stages,
                device,
                group=self.group,
                overlap=overlap_grad_reduce,
                on_last_backward=(
                    functools.partial(grad_sync.start, index)
                    if grad_sync is not None and overlap_grad_reduce
                    else None
                ),
            )
            for index, (stage, chunk) in enumerate(chunks)
        ]
        self.has_loss = any(stage.has_head for stage, _ in chunks)
        self.forward_only = PipelineForward(chunks, dims, v_shaped=self.schedule.v_shaped)
        self._schedules: dict[int, Any] = {}
        self._sums: list[torch.Tensor] = []
        self._factor = 1.0
        self._score: StageScore | None = None
        self._metrics: list[dict[str, float]] = []
        self.metrics: dict[str, float] = {}
        """The last `run_scored` step's metric sums (empty off the last stage)."""
        self.grad_sync = grad_sync
        last_rank = stage_rank(num_stages - 1, dims.pp, self.schedule.v_shaped)
        self.tied = EmbeddingGroup.build(chunks, dims, last_rank)
        # The last stage's head copy counts once in the gradient norm (as the embedding).
        self.tied_copy = self.tied.copy if self.tied is not None else None

    def _loss(self, logits_BSV: torch.Tensor, target_BS2: torch.Tensor) -> torch.Tensor:
        if self._score is not None:
            loss_sum, metrics = self._score(logits_BSV, target_BS2)
            self._metrics.append(metrics)
        else:
            labels, mask = target_BS2[..., 0].long(), target_BS2[..., 1].float()
            loss_sum = tp_cross_entropy_sum(logits_BSV, labels, mask)
        self._sums.append(loss_sum.detach())
        return loss_sum * self._factor

    def _schedule(self, n_micro: int) -> Any:
        if n_micro not in self._schedules:
            cls = self.schedule.schedule_class
            stage: Any = self.stages if self.schedule.multi_stage else self.stages[0]
            if n_micro < self.pp:
                raise ValueError(
                    f"a step has {n_micro} micro-batches but --pipeline-model-parallel-size is "
                    f"{self.pp}; raise --global-batch-size to at least {self.pp} x "
                    "--micro-batch-size x data-parallel size (more micro-batches, smaller bubble)"
                )
            self._schedules[n_micro] = cls(stage, n_micro, loss_fn=self._loss, scale_grads=False)
        return self._schedules[n_micro]

    def finish_gradients(self) -> None:
        """After the schedule: complete the data-parallel averaging, then the tied-weight sum."""
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if self.tied is not None:
            self.tied.all_reduce()

    def norm_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """`model`'s parameters counted in the pipeline-wide gradient norm (a tied head copy is
        the embedding's second holder and is counted once, on the first stage)."""
        return [p for p in model.parameters() if p is not self.tied_copy]

    def run(self, micro: list[dict[str, torch.Tensor]], factor: float) -> torch.Tensor:
        """Forward and backward of all micro-batches (each [B, S]); gradients of `loss·factor`.

        Returns this rank's summed token loss (0 off the last stage).
        """
        batch = {k: torch.cat([m[k] for m in micro]) for k in ("input_ids", "position_ids")}
        target = torch.stack(
            [torch.cat([m["labels"] for m in micro]).double(),
             torch.cat([m["loss_mask"] for m in micro]).double()],
            dim=-1,
        )  # fmt: skip
        return self._step(batch["input_ids"], batch["position_ids"], target, len(micro), factor)

    def run_scored(
        self,
        ids_BS: torch.Tensor,
        target: torch.Tensor,
        n_micro: int,
        factor: float,
        score: StageScore,
    ) -> torch.Tensor:
        """`run` for an objective other than next-token cross entropy: `ids_BS` [n·B, S] and
        `target` [n·B, ...] hold the step's n micro-batches one after another (the schedule
        splits both along the rows), and the last stage scores each micro-batch's output with
        `score(output, target rows)` -> (loss sum, metric sums), collected in `self.metrics`."""
        self._score, self._metrics = score, []
        try:
            positions = torch.arange(ids_BS.shape[1], device=ids_BS.device).expand_as(ids_BS)
            loss = self._step(ids_BS, positions, target, n_micro, factor)
        finally:
            self._score = None
        # As for the sums: the shape inference's extra call is not a micro-batch.
        self.metrics = {}
        for metrics in self._metrics[-n_micro:] if self._metrics else []:
            for name, value in metrics.items():
                self.metrics[name] = self.metrics.get(name, 0.0) + value
        return loss

    def _step(
        self,
        ids_BS: torch.Tensor,
        pos_BS: torch.Tensor,
        target: torch.Tensor,
        n_micro: int,
        factor: float,
    ) -> torch.Tensor:
        self._sums, self._factor = [], factor
        schedule = self._schedule(n_micro)
        first = any(s.is_first for s in self.stages)
        args = (ids_BS,) if first else ()
        schedule.step(*args, target=target, position_ids_BS=pos_BS)
        if not self._sums:
            return torch.zeros((), dtype=torch.float64)
        # The first step's shape inference evaluates the loss once more: keep the real calls.
        return torch.stack([s.double() for s in self._sums[-n_micro:]]).sum()


class PipelineForward:
    """Forward-only pass through the stages, one micro-batch, in stage order (validation).

    No schedule: each rank waits for its chunk's input from the previous stage's rank, runs
    the chunk and sends the result on; the last stage scores it. Slow but exact, and it needs
    no micro-batch count, so validation works with any --eval-iters.
    """

    def __init__(
        self, chunks: list[tuple[Any, nn.Module]], dims: Any, *, v_shaped: bool = False
    ) -> None:
        self.v_shaped = v_shaped
        self.chunks = {stage.stage_index: chunk for stage, chunk in chunks}
        self.group = dims.submesh("pp").get_group()
        self.pp, self.num_stages = dims.pp, dims.pp * dims.virtual_pp
        self.tp, self.cp, self.sp = dims.tp, dims.cp, dims.sequence_parallel

    @torch.no_grad()
    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's summed token loss of `batch` (already CP-sharded; 0 off the last stage)."""
        out = self.output(batch["input_ids"], batch["position_ids"])
        if out is None:
            return torch.zeros((), dtype=torch.float64)
        return tp_cross_entropy_sum(out, batch["labels"], batch["loss_mask"]).double()

    @torch.no_grad()
    def output(self, ids_BS: torch.Tensor, pos_BS: torch.Tensor) -> torch.Tensor | None:
        """The last stage's output for `ids_BS` (logits, or a value head's scores) on the rank
        that runs it; None on the others (every pipeline rank calls this together)."""
        me = dist.get_rank(self.group)
        # Output of the previous stage when it ran here too (V placement).
        carried: Any = None
        for index in range(self.num_stages):
            chunk = self.chunks.get(index)
            if chunk is None:
                continue
            x: Any
            if index == 0:
                x = ids_BS
            elif self._rank(index - 1) == me:
                x = carried
            else:
                x = self._receive(index, ids_BS.shape, chunk)
            out = chunk(x, position_ids_BS=pos_BS)
            if index == self.num_stages - 1:
                return out
            if self._rank(index + 1) == me:
                carried = out
            else:
                dist.send(out.contiguous(), self._global(index + 1), group=self.group)
        return None

    def _receive(self, index: int, shape_BS: torch.Size, chunk: Any) -> torch.Tensor:
        b, s = shape_BS
        if self.sp:
            s //= self.tp
        param = next(chunk.parameters())
        hidden = torch.empty(b, s, chunk.config.hidden_size, dtype=param.dtype, device=param.device)
        dist.recv(hidden, self._global(index - 1), group=self.group)
        return hidden

    def _rank(self, stage_index: int) -> int:
        return stage_rank(stage_index, self.pp, self.v_shaped)

    def _global(self, stage_index: int) -> int:
        return dist.get_global_rank(self.group, self._rank(stage_index))


def pipeline_norm_group(dims: Any) -> dist.ProcessGroup:
    """The group over which stage gradient norms add up (pipeline ranks)."""
    return dims.submesh("pp").get_group()
