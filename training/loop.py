"""The training loop: micro-batches with accumulation, precision, clipping, schedule, eval, metrics.

Shapes: B micro-batch, S sequence, V vocab. The loss of a step is the mean over every unmasked
token of the global batch (all micro-batches, all data-parallel ranks): each micro-batch's
summed token loss is divided by the step's global token count (times the data-parallel size,
which the gradient averaging of DDP/FSDP divides out again), so `mbs 2 x 2 micro-batches` equals
`mbs 4 x 1` exactly and padded or prompt tokens never dilute the loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels import device, peak_flops
from models.accounting import flops_per_token
from models.config import ModelConfig
from models.moe import set_aux_loss_scale
from parallel.adaptive_recompute import AdaptiveRecompute
from parallel.data_parallel import no_sync
from parallel.parallel_dims import build_dims
from parallel.parallelize import ModelParallelFeed
from parallel.tp_random import tp_seed_offset
from training import finetune
from training.batching import MicroBatchCalculator, MicroBatchStream, stack_samples
from training.checkpoint import PathGuard
from training.config import TrainingConfig
from training.loss_scaler import build_loss_scaler
from training.lr_schedule import scheduler_for
from training.metrics import (
    MetricsWriter,
    StepMetrics,
    format_line,
    throughput,
)
from training.model_config import apply_attention_backend
from training.objectives import ForwardContext, ObjectiveOutput, build_objective
from training.objectives.grpo import GRPOLoss
from training.objectives.layout import RL_STAGES
from training.objectives.ppo import PPOLoss
from training.optimizer import build_param_swap, build_training_optimizer
from training.precision import plan_precision
from training.profiling import StepProfiler
from training.rl_setup import RolloutFactory, attach_rl
from training.setup import (
    build_data,
    build_model_config,
    build_parallel,
    create_model,
    load_checkpoint,
    materialize_model,
    save_checkpoint,
)
from training.trainer_state import StepCounters, TrainerState

log = logging.getLogger(__name__)
METRICS_STDOUT_ENV = "MESHLINE_METRICS_STDOUT"
SAVE_ON_STOP_ENV = "MESHLINE_SAVE_ON_STOP"
METRICS_PREFIX = "MESHLINE_METRICS "


class NonFiniteLossError(FloatingPointError):
    """Raised under --nan-policy stop when the loss or gradients are NaN/Inf."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    loss: float
    grad_norm: float
    skipped: bool
    nan: bool
    tokens: int
    global_batch: int
    metrics: dict[str, float] = field(default_factory=dict)
    """The objective's extra sums over this rank's micro-batches (`ObjectiveOutput.metrics`)."""


@dataclass
class RunSummary:
    """End-of-run numbers (for the CLI summary and the gRPC service)."""

    steps: int
    first_loss: float
    final_loss: float
    val_loss: float | None
    tokens_per_s: float
    skipped: int
    nan: int
    checkpoint: str | None
    stopped_by: str | None = None
    """What ended the run before --train-iters (an --exit-* flag, a stop signal), if anything."""


@dataclass
class _FitProgress:
    """What `Trainer.fit` accumulates over its steps."""

    first_loss: float = math.nan
    """The first finite loss of the run."""
    final_loss: float = math.nan
    """The latest finite loss."""
    val_loss: float | None = None
    """The latest validation loss, if evaluated."""
    window: list[StepResult] = field(default_factory=list)
    """Steps since the last log line."""
    window_start: float = field(default_factory=time.perf_counter)
    """When the log window began (perf_counter seconds)."""
    run_start: float = field(default_factory=time.perf_counter)
    """When the run began (perf_counter seconds)."""
    run_tokens: int = 0
    """Tokens trained on in this run."""
    saved: tuple[int, str] | None = None
    """(step, directory) of the last --save-interval save."""

    def record(self, result: StepResult) -> None:
        self.window.append(result)
        self.run_tokens += result.tokens
        if math.isnan(self.first_loss) and math.isfinite(result.loss):
            self.first_loss = result.loss
        if math.isfinite(result.loss):
            self.final_loss = result.loss


class Trainer(TrainerState):
    """Builds the model, data, optimizer and schedule for `config` and runs the steps."""

    def __init__(
        self,
        config: TrainingConfig,
        *,
        model: nn.Module | None = None,
        datasets: tuple[Any, Any] | None = None,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
        path_guard: PathGuard | None = None,
        rollouts: RolloutFactory | None = None,
    ) -> None:
        self._started = time.monotonic()  # --exit-duration-in-mins counts the set-up too
        self.config = config
        self.path_guard = path_guard
        self._init_layout(config)
        self.on_metrics = on_metrics
        self._init_objective(config, path_guard)
        device.seed_everything(config.run.seed)
        datasets, wrap_inner = self._init_data_and_model(config, model, datasets, rollouts)
        self._init_auto_recompute(config)
        self._init_optimization(config, wrap_inner)
        self.train_data, self.valid_data = datasets
        self.state = StepCounters()
        self.stream = self._train_stream()
        self._init_metrics(config)
        self._loss_ema: float | None = None
        self._objective_begun = False
        self._base_quantized = False
        self.checkpoints = None
        # Dropout differs across data/context/pipeline ranks but not within a TP group, whose
        # ranks hold replicated activations (sharded regions fork their own: tp_random).
        tp = config.parallel.tensor_model_parallel_size
        device.seed_everything(config.run.seed, rank_offset=tp_seed_offset(self.rank, tp))

    def _init_layout(self, config: TrainingConfig) -> None:
        """This rank, the validated config, the device and the run's parallel layout."""
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        config.validate(self.world_size)
        self.platform = device.current()
        self.device = self.platform.torch_device()
        # The run's parallel layout, built once: the feed, the data ranks and the parallelized
        # model all read it.
        self.dims = build_dims(config, self.world_size)
        self.dp_size = self.dims.dp
        self.dp_rank = self.rank
        self.feed = None
        if self.dims.is_model_parallel:
            self.feed = ModelParallelFeed(self.dims)
            self.dp_rank = self.dims.dp_rank

    def _init_objective(self, config: TrainingConfig, path_guard: PathGuard | None) -> None:
        """The objective (refused under pipeline parallelism when the last stage cannot score
        it) and the precision plan."""
        self.objective = build_objective(config.run.stage, config.run, path_guard, config)
        if self.dims.pp > 1 and not (
            self.objective.pipeline_loss or self.objective.pipeline_scored
        ):
            raise ValueError(
                f"--stage {config.run.stage} under --pipeline-model-parallel-size "
                f"{self.dims.pp}: the pipeline's last stage cannot score this objective; "
                "drop pipeline parallelism for this objective"
            )
        self.plan = plan_precision(
            config.precision,
            config.parallel.zero_stage,
            self.dp_size * config.parallel.context_parallel_size,
        )

    def _init_data_and_model(
        self,
        config: TrainingConfig,
        model: nn.Module | None,
        datasets: tuple[Any, Any] | None,
        rollouts: RolloutFactory | None,
    ) -> tuple[tuple[Any, Any], Any]:
        """The datasets (built unless given), the model in the plan's dtype and parallelized;
        returns (datasets, the optimizer's inner-wrap hook)."""
        vocab_hint = None
        self.collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]] = (
            stack_samples
        )
        if datasets is None:
            datasets, vocab_hint, self.collate = build_data(config, self.dp_size)
        if config.run.stage in RL_STAGES and rollouts is not None:  # online: prompts, rewards
            assert isinstance(self.objective, GRPOLoss | PPOLoss)
            attach_rl(self.objective, config, datasets[0], rollouts, self.device)
        self.model_config = build_model_config(config, vocab_hint)
        # --param-nvme-path: the model stays on the meta device until ZeRO-3 has sharded it, so no
        # rank ever holds the whole model (its init would otherwise be the run's peak).
        sharded_init = (
            model is None
            and config.parallel.param_nvme_path is not None
            and not self.model_config.tie_word_embeddings  # to_empty would untie them
        )
        if model is None:
            model = self.objective.prepare_model(
                create_model(
                    self.model_config, self.device, config.run.seed, materialize=not sharded_init
                )
            )
            # The network trained, as checkpoints record it (a reward model's value head).
            self.model_config = getattr(model, "config", self.model_config)
        model = model.to(self.plan.model_dtype)
        apply_attention_backend(model, config.attention_backend())
        self.model, self.mesh, wrap_inner = build_parallel(model, config, self.plan, self.dims)
        if sharded_init:
            materialize_model(self.model, self.device, config.run.seed)
        return datasets, wrap_inner

    def _init_auto_recompute(self, config: TrainingConfig) -> None:
        """--auto-recompute-device-size: the adaptive recompute controller over the layers."""
        self.auto_recompute = None
        if config.parallel.auto_recompute_device_size is not None:
            layers = self.model.layers
            assert isinstance(layers, nn.ModuleDict), "CausalLM keeps its layers in a ModuleDict"
            self.auto_recompute = AdaptiveRecompute(
                layers,
                config.parallel.auto_recompute_device_size,
                config.parallel.auto_recompute_profiling_step,
            )

    def _init_optimization(self, config: TrainingConfig, wrap_inner: Any) -> None:
        """Optimizer, LR schedule, loss scaler and the micro-batch calculator."""
        # --param-nvme-path: the parameter shards leave memory for a swap file before the
        # optimizer (which steps them from that file) is built.
        par = config.parallel
        self.param_swap = build_param_swap(
            self.model, par.param_nvme_path, par.param_nvme_buffer_count
        )
        self.optimizer = build_training_optimizer(
            self.model,
            config.optim,
            self.plan,
            wrap_inner=wrap_inner,
            offload=config.parallel_config().optimizer_offload(),
            param_swap=self.param_swap,
        )
        self.scheduler = scheduler_for(
            self.optimizer, config.optim, config.lr_warmup_iters(), config.lr_decay_iters()
        )
        self.scaler = build_loss_scaler(config.precision)
        self.batches = MicroBatchCalculator(
            config.global_batch_size(self.world_size),
            config.batch.micro_batch_size,
            self.dp_size,
            config.batch.rampup_batch_size,
        )

    def _init_metrics(self, config: TrainingConfig) -> None:
        """The metrics writer (rank 0) and the FLOP accounting MFU is reported against."""
        self.writer = MetricsWriter(config.run.log_dir, enabled=self.rank == 0)
        self.flops_per_token = _flops_per_token(self.model_config, config.model.seq_length)
        peak = peak_flops.peak_tflops(config.run.peak_tflops)
        self.peak_tflops = peak.tflops
        if self.rank == 0:
            log.info("MFU against %.3g TFLOP/s per device (%s)", peak.tflops, peak.source)

    # ------------------------------------------------------------------ steps

    def _train_stream(self) -> MicroBatchStream:
        return MicroBatchStream(
            self.train_data,
            consumed_samples=self.state.consumed_samples,
            micro_batch_size=self.config.batch.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            collate=self.collate,
        )

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value)
        return value

    def _forward_loss_sum(self, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        if self.feed is not None and "input_ids" in batch:  # a token batch (not pairs)
            batch = self.feed.shard(batch)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        runner = getattr(self.model, "runner", None)
        if runner is not None and self.objective.pipeline_scored:
            return self._pipeline_forward_scored(runner, batch)
        if runner is not None:  # the pipeline's last stage scores with the objective's loss
            with self.plan.autocast(self.platform.type):
                loss = runner.forward_only.loss_sum(batch)
            return ObjectiveOutput(loss)
        return self.objective.compute(self.model, batch, self._forward_context())

    def _forward_context(self) -> ForwardContext:
        runner = getattr(self.model, "runner", None)
        return ForwardContext(
            autocast=lambda: self.plan.autocast(self.platform.type),
            feed=self.feed,
            pipeline=runner.forward_only if runner is not None else None,
        )

    # An objective the pipeline's last stage scores itself (`Objective.pipeline_scored`: the
    # preference stages) packs its micro-batches as the schedule's input and target.

    def _pipeline_forward_scored(
        self, runner: Any, batch: dict[str, torch.Tensor]
    ) -> ObjectiveOutput:
        """Forward only (validation): the last stage's result, zero elsewhere."""
        ctx = self._forward_context()
        self.objective.prepare_step(self.model, [batch], ctx)
        ids, target = self.objective.pipeline_inputs([batch])
        with self.plan.autocast(self.platform.type):
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            out = runner.forward_only.output(ids.to(self.device), positions)
            if out is None:
                return ObjectiveOutput(torch.zeros((), dtype=torch.float64))
            scored = self.objective.pipeline_score(out, target.to(self.device), ctx)
        return ObjectiveOutput(scored.loss_sum.detach().double(), scored.metrics)

    def _pipeline_step_scored(
        self, runner: Any, micro: list[dict[str, torch.Tensor]], factor: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward of a step's micro-batches: (this rank's loss sum, metric sums;
        zeros off the last stage)."""
        ctx = self._forward_context()
        ids, target = self.objective.pipeline_inputs(micro)

        def score(
            output: torch.Tensor, rows: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, float]]:
            scored = self.objective.pipeline_score(output, rows, ctx)
            return scored.loss_sum.float(), scored.metrics

        loss = runner.run_scored(
            ids.to(self.device), target.to(self.device), len(micro), factor, score
        )
        zeros = dict.fromkeys(self.objective.metric_names, 0.0)
        return loss, zeros | runner.metrics

    def train_step(self) -> StepResult:
        """Run one optimizer step (all micro-batches of the current global batch)."""
        self._quantize_base()
        if not self._objective_begun:  # after any --load, before the first step of this process
            self.objective.begin(self.model, self.state.step)
            self._objective_begun = True
        n_micro = self.batches.num_micro_batches(self.state.consumed_samples)
        global_batch = self.batches.global_batch(self.state.consumed_samples)
        micro = [self.stream.next() for _ in range(n_micro)]
        with self._parallel_context():  # e.g. DPO's reference pass, before the step's forwards
            self.objective.prepare_step(self.model, micro, self._forward_context())
        local_tokens = sum(self.objective.count(b) for b in micro)
        grad_average = self.dp_size
        if self.feed is not None:
            local_tokens *= self.feed.token_weight
            grad_average = self.feed.grad_average_size
        tokens = self._all_reduce(torch.tensor([local_tokens], dtype=torch.float64))
        global_tokens = max(float(tokens.item()), 1.0)
        scale = self.scaler.scale
        set_aux_loss_scale(scale / n_micro)
        loss_sum = torch.zeros((), dtype=torch.float64)
        metrics: dict[str, float] = {}
        self.model.train()
        if self.auto_recompute is not None:
            self.auto_recompute.before_step()
        runner = getattr(self.model, "runner", None)
        if runner is not None and self.feed is not None:
            with self._parallel_context(), self.plan.autocast(self.platform.type):
                factor = grad_average * scale / global_tokens
                if self.objective.pipeline_scored:
                    step_loss, metrics = self._pipeline_step_scored(runner, micro, factor)
                    loss_sum += step_loss
                else:
                    shards = [self.feed.shard(b) for b in micro]
                    loss_sum += runner.run(shards, factor)
        for index, batch in enumerate(micro if runner is None else []):
            last = index == n_micro - 1
            sync = contextlib.nullcontext() if last or self.world_size == 1 else no_sync(self.model)
            with sync, self._parallel_context():
                output = self._forward_loss_sum(batch)
                (output.loss_sum.float() * (grad_average * scale / global_tokens)).backward()
            loss_sum += output.loss_sum.detach().double().cpu()
            for name, value in output.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value
        pipeline_norm = None
        if self.feed is not None:
            loss_sum *= self.feed.loss_weight
            pipeline_norm = self.feed.clip_pipeline_grads(
                self.model, self.config.optim.clip_grad, scale
            )
        loss = float(self._all_reduce(loss_sum).item()) / global_tokens
        self.state.consumed_samples += global_batch
        self.state.step += 1
        if self.auto_recompute is not None:
            self.auto_recompute.after_step(self.state.step)
        tokens_done = sum(self.objective.tokens(b) for b in micro)
        if not math.isfinite(loss):
            return self._on_nonfinite(loss, "loss", tokens_done, global_batch)
        stats = self.optimizer.step(scale)
        self.scaler.update(stats.found_inf)
        if stats.found_inf:
            if self.config.precision.fp16:
                self.state.skipped += 1
                return StepResult(loss, math.nan, True, False, tokens_done, global_batch, metrics)
            return self._on_nonfinite(loss, "gradients", tokens_done, global_batch)
        self.scheduler.step()
        self._check_spike(loss)
        grad_norm = stats.grad_norm if pipeline_norm is None else pipeline_norm
        return StepResult(loss, grad_norm, False, False, tokens_done, global_batch, metrics)

    def _parallel_context(self) -> contextlib.AbstractContextManager[None]:
        return self.feed.context() if self.feed is not None else contextlib.nullcontext()

    def _on_nonfinite(self, loss: float, what: str, tokens: int, global_batch: int) -> StepResult:
        self.optimizer.zero_grad()
        self.state.nan += 1
        if self.config.run.nan_policy == "stop":
            raise NonFiniteLossError(
                f"step {self.state.step}: the {what} became NaN/Inf (loss {loss}); lower --lr, "
                "enable --clip-grad, or pass --nan-policy skip to skip such steps"
            )
        log.warning("step %d: NaN/Inf %s; step skipped (--nan-policy skip)", self.state.step, what)
        return StepResult(loss, math.nan, True, True, tokens, global_batch)

    def _check_spike(self, loss: float) -> None:
        # A ratio to the running mean means something only for a loss bounded below by 0 (cross
        # entropy, the pairwise losses); GRPO/PPO minimise a surrogate of either sign, whose mean
        # may be near 0 or negative, and every step would "spike".
        if self.config.run.stage in RL_STAGES:
            return
        factor = self.config.run.spike_factor
        if (
            self._loss_ema is not None
            and self._loss_ema > 0
            and factor > 0
            and self.state.step > 10
            and loss > factor * self._loss_ema
        ):
            log.warning(
                "step %d: loss spike %.4f is over %.1fx its running mean %.4f",
                self.state.step,
                loss,
                factor,
                self._loss_ema,
            )
        self._loss_ema = loss if self._loss_ema is None else 0.9 * self._loss_ema + 0.1 * loss

    def _quantize_base(self) -> None:
        """--base-quant: the frozen base goes quantized once, after any --load (the checkpoint
        loads float weights), before the first step or evaluation."""
        if self._base_quantized:
            return
        self._base_quantized = True
        sizes = finetune.quantize_base(self.model, self.config)
        if sizes is not None and self.rank == 0:
            log.info(
                "--base-quant %s: frozen base weights %.1f MiB -> %.1f MiB",
                self.config.peft.base_quant,
                sizes[0] / 2**20,
                sizes[1] / 2**20,
            )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted validation loss over --eval-iters micro-batches (the same ones each time)."""
        self._quantize_base()
        stream = MicroBatchStream(
            self.valid_data,
            consumed_samples=0,
            micro_batch_size=self.config.batch.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            collate=self.collate,
        )
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        for _ in range(max(self.config.run.eval_iters, 1)):
            batch = stream.next()
            with self._parallel_context():
                totals[0] += float(self._forward_loss_sum(batch).loss_sum.double())
            totals[1] += self.objective.count(batch)
        if self.feed is not None:
            totals[0] *= self.feed.loss_weight
            totals[1] *= self.feed.token_weight
        self.model.train()
        totals = self._all_reduce(totals)
        return float(totals[0] / max(float(totals[1]), 1.0))

    # ------------------------------------------------------------------ run

    def fit(
        self,
        stop: Callable[[], bool] | None = None,
        *,
        save_on_stop: bool | Callable[[], bool] = True,
    ) -> RunSummary:
        """Train until --train-iters, --exit-interval, --exit-duration-in-mins or `stop()`; log,
        evaluate, profile (--profile) and save on schedule.

        The final checkpoint (with --save) is written also when stopped early: always for the
        --exit-* flags, and after `stop()` unless `save_on_stop` is (or, called once the run
        has stopped, returns) False.
        """
        run = self.config.run
        fitting = _FitProgress()
        stopped = False
        stopped_by: str | None = None
        profiler = StepProfiler(run, self.rank, self.platform)
        profiler.check_start(self.state.step)
        try:
            while self.state.step < run.train_iters:
                profiler.before_step(self.state.step)
                result = self.train_step()
                profiler.after_step(self.state.step)
                fitting.record(result)
                self._on_schedule(fitting, self.state.step)
                if stop is not None and stop():
                    stopped, stopped_by = True, "a stop signal"
                    break
                stopped_by = self._exit_reason(self.state.step)
                if stopped_by is not None:
                    break
        finally:
            profiler.close()
        if stopped and callable(save_on_stop):
            save_on_stop = save_on_stop()
        # --exit-interval / --exit-duration-in-mins always save (Megatron's behaviour).
        wanted = run.save and (save_on_stop or not stopped)
        checkpoint = None
        if wanted:  # an --exit-interval step that --save-interval just saved is not saved again
            saved = fitting.saved
            checkpoint = saved[1] if saved and saved[0] == self.state.step else self.save()
        if self.checkpoints is not None:
            self.checkpoints.wait()
        self.writer.close()
        elapsed = time.perf_counter() - fitting.run_start
        return RunSummary(
            steps=self.state.step,
            first_loss=fitting.first_loss,
            final_loss=fitting.final_loss,
            val_loss=fitting.val_loss,
            tokens_per_s=fitting.run_tokens / elapsed if elapsed > 0 else 0.0,
            skipped=self.state.skipped,
            nan=self.state.nan,
            checkpoint=checkpoint,
            stopped_by=stopped_by,
        )

    def _on_schedule(self, fitting: _FitProgress, step: int) -> None:
        """Log, evaluate and save when `step` (steps done) is on their intervals."""
        run = self.config.run
        if step % run.log_interval == 0 or step == run.train_iters:
            self.platform.synchronize()
            now = time.perf_counter()
            self._log(fitting.window, now - fitting.window_start)
            fitting.window, fitting.window_start = [], time.perf_counter()
        if run.eval_interval and (step % run.eval_interval == 0 or step == run.train_iters):
            fitting.val_loss = self.evaluate()
            ppl = self.writer.write_eval(step, fitting.val_loss)
            if self.rank == 0:
                print(
                    f"validation at step {step} | loss {fitting.val_loss:.4f} | ppl {ppl:.2f}",
                    flush=True,
                )
        save_due = run.save and run.save_interval and step % run.save_interval == 0
        if save_due and step != run.train_iters:
            fitting.saved = (step, self.save())

    def _exit_reason(self, step: int) -> str | None:
        """The flag that ends the run after `step` (steps done), agreed on every rank, or None."""
        run = self.config.run
        if step >= run.train_iters:
            return None
        if run.exit_interval and step % run.exit_interval == 0:
            return f"--exit-interval {run.exit_interval}"
        if run.exit_duration_in_mins:
            minutes = (time.monotonic() - self._started) / 60
            over = torch.tensor([1.0 if minutes >= run.exit_duration_in_mins else 0.0])
            if self.world_size > 1:  # the ranks' clocks differ: any one over ends them all
                dist.all_reduce(over, op=dist.ReduceOp.MAX)
            if over.item():
                return f"--exit-duration-in-mins {run.exit_duration_in_mins:g}"
        return None

    def _log(self, window: list[StepResult], seconds: float) -> None:
        good = [r for r in window if not r.skipped]
        # Rank 0 counts its data-parallel replica's tokens, which the replica's tensor, pipeline
        # and context ranks process together: per device, each of them has a share.
        tokens = sum(r.tokens for r in window) / self.dims.model_parallel
        tps, tflops, mfu = throughput(tokens, seconds, self.flops_per_token, self.peak_tflops)
        metrics = StepMetrics(
            step=self.state.step,
            loss=_mean([r.loss for r in window if math.isfinite(r.loss)]),
            grad_norm=_mean([r.grad_norm for r in good]),
            lr=self.scheduler.get_lr(),
            tokens_per_s=tps,
            tflops=tflops,
            mfu=mfu,
            mem_gb=device.memory_stats().peak / 2**30,
            skipped=self.state.skipped,
            nan=self.state.nan,
            loss_scale=self.scaler.scale,
            global_batch=window[-1].global_batch,
            elapsed_s=seconds,
        )
        extra = self._objective_metrics(window)  # collective: before the rank-0 return
        if self.rank != 0:
            return
        self.writer.write(metrics)
        line = format_line(metrics, self.config.run.train_iters)
        print(line + "".join(f" | {k} {v:.4g}" for k, v in extra.items()), flush=True)
        record = asdict(metrics) | ({"objective": extra} if extra else {})
        if self.on_metrics is not None:
            self.on_metrics(record)
        if nonce := os.environ.get(METRICS_STDOUT_ENV):
            # The launcher's nonce frames the line, so echoed user data cannot forge one.
            framing = "" if nonce == "1" else f"{nonce} "
            print(METRICS_PREFIX + framing + json.dumps(record), flush=True)

    def _objective_metrics(self, window: list[StepResult]) -> dict[str, float]:
        """The objective's extra sums over the logged steps and the job's replicas (none for sft).

        Every rank's objective names the same metrics; a tensor-parallel group holds one copy, as
        for the loss sum."""
        names = sorted({name for result in window for name in result.metrics})
        if not names:
            return {}
        local = [sum(result.metrics.get(name, 0.0) for result in window) for name in names]
        values = torch.tensor(local, dtype=torch.float64)
        if self.feed is not None:
            values *= self.feed.loss_weight
        sums = dict(zip(names, self._all_reduce(values).tolist(), strict=True))
        return self.objective.summarize(sums)

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> str:
        """Save a checkpoint of the current step under --save; returns its directory."""
        return save_checkpoint(self)

    def load(self) -> int:
        """Resume from --load (respecting --finetune, --no-load-optim, --no-load-rng); returns the step."""
        step = load_checkpoint(self)
        self.stream = self._train_stream()
        return step


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _flops_per_token(model_config: ModelConfig, seq_length: int) -> float:
    return float(flops_per_token(model_config, seq_length))
