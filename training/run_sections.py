"""Training config sections for precision, the run and parallelism (see `train_config`).

Each field is a flag (`loss_scale_window` -> `--loss-scale-window`); the attribute docstring under
it is the flag's help text. Sections validate themselves when built (ValueError naming the flag).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from training.config_sections import flag_name

if TYPE_CHECKING:  # torch-free at import (the CLI's prechecks read these sections)
    from kernels.quantization import WeightScheme


@dataclass
class PrecisionSection:
    """Compute precision and loss scaling."""

    fp16: bool = False
    """Train in fp16 with fp32 master weights and (dynamic) loss scaling."""
    bf16: bool = False
    """Train in bf16 with fp32 master weights."""
    loss_scale: float | None = None
    """A constant loss scale (fp16); unset means dynamic scaling."""
    initial_loss_scale: float = 2.0**32
    """Starting value of the dynamic loss scale."""
    min_loss_scale: float = 1.0
    """The dynamic loss scale never drops below this."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves."""
    release_fp32_grad: bool = False
    """Keep no persistent fp32 gradient copy: cast low-precision grads inside the optimizer step."""
    qat: Literal["int8", "int4"] | None = None
    """Quantization-aware training: decoder linears compute with weights fake-quantized as
    `meshline convert --save-format quantized --quantize` will store them (models/qat.py)."""
    qat_group_size: int | None = None
    """Inputs per scale under --qat (default: per output channel for int8, 128 for int4)."""
    fp8: Literal["tensorwise", "rowwise"] | None = None
    """Run the decoder layers' linear matmuls in FP8 (torch._scaled_mm, dynamic scaling by the
    current amax per tensor or per row); needs --bf16; weights and optimizer stay bf16/fp32
    (kernels/fp8_linear.py)."""
    fp8_grad_format: Literal["e5m2", "e4m3"] | None = None
    """FP8 encoding of output gradients under --fp8 (default: e5m2 for tensorwise, Megatron's
    hybrid format; rowwise takes e4m3 only)."""

    def fp8_grad_dtype_name(self) -> str:
        """'e5m2' or 'e4m3': the gradient encoding --fp8 / --fp8-grad-format resolve to."""
        if self.fp8_grad_format is not None:
            return self.fp8_grad_format
        return "e5m2" if self.fp8 == "tensorwise" else "e4m3"

    def qat_scheme(self) -> WeightScheme | None:
        """The `kernels.quantization.WeightScheme` --qat / --qat-group-size describe, or None."""
        # kernels.quantization loads torch: the config sections import without it
        from kernels.quantization import WeightScheme

        if self.qat is None:
            return None
        group = self.qat_group_size
        if group is None and self.qat == "int4":
            group = 128
        return WeightScheme(8 if self.qat == "int8" else 4, group, True)

    def __post_init__(self) -> None:
        if self.qat_group_size is not None and self.qat is None:
            raise ValueError("--qat-group-size needs --qat int8|int4")
        try:
            self.qat_scheme()
        except ValueError as exc:
            raise ValueError(
                f"--qat {self.qat} --qat-group-size {self.qat_group_size}: {exc}"
            ) from exc
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are exclusive; choose one")
        self._check_fp8()
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {self.loss_scale}")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError("--initial-loss-scale and --min-loss-scale must be positive")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"--min-loss-scale ({self.min_loss_scale}) exceeds --initial-loss-scale ({self.initial_loss_scale})"
            )
        if self.loss_scale_window <= 0 or self.hysteresis <= 0:
            raise ValueError("--loss-scale-window and --hysteresis must be positive")
        if self.release_fp32_grad and not (self.fp16 or self.bf16):
            raise ValueError(
                "--release-fp32-grad only applies to --fp16 or --bf16 training (fp32 grads are the model's)"
            )

    def _check_fp8(self) -> None:
        if self.fp8 is None:
            if self.fp8_grad_format is not None:
                raise ValueError(
                    f"--fp8-grad-format {self.fp8_grad_format} needs --fp8 tensorwise|rowwise"
                )
            return
        flag = f"--fp8 {self.fp8}"
        if not self.bf16:
            given = "--fp16" if self.fp16 else "fp32 (no --bf16)"
            raise ValueError(
                f"{flag} needs --bf16: FP8 matmuls read and write bf16 activations around bf16 "
                f"weights with fp32 masters; {given} is not supported with it: add --bf16"
            )
        if self.fp8 == "rowwise" and self.fp8_grad_format == "e5m2":
            raise ValueError(
                f"{flag} --fp8-grad-format e5m2: row-wise FP8 matmuls take e4m3 operands only; "
                "use --fp8-grad-format e4m3, or --fp8 tensorwise for e5m2 gradients"
            )
        if self.qat is not None:
            raise ValueError(
                f"{flag} and --qat {self.qat} both replace the decoder linears; choose one"
            )

    @property
    def dtype_name(self) -> str:
        """'fp16', 'bf16' or 'fp32'."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"


@dataclass
class RunSection:
    """Length of the run, evaluation, checkpoints, logging and failure policy."""

    train_iters: int = 1000
    """Optimizer steps to train for."""
    eval_interval: int = 1000
    """Run validation every this many steps (0 disables it)."""
    eval_iters: int = 10
    """Validation micro-batches per evaluation."""
    save: str | None = None
    """Checkpoint directory to save to."""
    save_interval: int = 0
    """Save every this many steps (0: only at the end when --save is given)."""
    keep_last_checkpoints: int = 0
    """Keep only this many most recent checkpoints (0 keeps all)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    load: str | None = None
    """Checkpoint directory to resume from."""
    no_load_optim: bool = False
    """Do not restore the optimizer state when loading."""
    no_load_rng: bool = False
    """Do not restore RNG states when loading."""
    no_save_optim: bool = False
    """Save checkpoints without the optimizer state: the weights, schedule and counters only (an
    fp32 Adam checkpoint shrinks to about a third); resuming from one needs --no-load-optim, or
    --finetune."""
    no_save_rng: bool = False
    """Save checkpoints without the RNG states; resuming from one needs --no-load-rng, or
    --finetune."""
    finetune: bool = False
    """Load only the weights and start counting from step 0."""
    exit_on_missing_checkpoint: bool = False
    """With --load: stop with an error when it holds no checkpoint (default: start fresh)."""
    seed: int = 1234
    """Random seed for weights, data order and dropout."""
    log_interval: int = 10
    """Print a metrics line every this many steps."""
    log_dir: str | None = None
    """Directory for metrics.csv and TensorBoard events."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU (default: the device model's table entry, or a CPU
    measured at start-up; see docs/training.md)."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a NaN/Inf loss or gradient: stop with a message, or skip the step and count it."""
    spike_factor: float = 3.0
    """Warn when the loss exceeds this multiple of its running mean (0 disables; not applied to
    the grpo and ppo stages, whose loss is a surrogate of either sign)."""
    exit_interval: int = 0
    """Stop after the step whose number is a multiple of this, saving first when --save is given
    (0: run to --train-iters)."""
    exit_duration_in_mins: float = 0.0
    """Stop at the first step boundary after the run has lasted this many minutes (set-up
    included), saving first when --save is given: for jobs with a wall-clock limit (0: none)."""
    profile: bool = False
    """Profile steps --profile-step-start to --profile-step-end with torch.profiler (torch_npu's on
    Ascend): a trace per profiled rank in --profile-save-path and a top-ops line in the log."""
    profile_step_start: int = 10
    """First profiled step (default 10), counted from 0 like the steps already done: the log's
    step 11 (the step before it runs as the profiler's warm-up)."""
    profile_step_end: int = 12
    """Profiling stops before this step (default 12): steps start .. end-1 are recorded."""
    profile_ranks: list[int] = field(default_factory=lambda: [-1])
    """Global ranks to profile (-1: every rank)."""
    profile_level: Literal["level0", "level1", "level2"] = "level0"
    """Ascend: torch_npu's profiler level (more detail, more overhead); CPU and CUDA runs record
    operators at any level, with the extras below."""
    profile_with_cpu: bool = False
    """Ascend: also record host-side operators (CPU and CUDA runs always record them)."""
    profile_with_stack: bool = False
    """Record the Python stack of every operator."""
    profile_with_memory: bool = False
    """Record tensor allocations and frees."""
    profile_record_shapes: bool = False
    """Record operator input shapes."""
    profile_save_path: str | None = None
    """Directory for the traces (default: `profile/` in --log-dir/--tensorboard-dir, where
    TensorBoard's profiler plugin finds them; without a log dir ./profile_dir)."""
    stage: Literal["sft", "rm", "dpo", "simpo", "orpo", "grpo", "ppo"] = "sft"
    """Training objective (MindSpeed-LLM's --stage; `training.objectives`): sft = next-token cross
    entropy over the unmasked labels, for pretraining and instruction tuning alike; rm = a reward
    model (scalar value head, pairwise loss), dpo = direct preference optimisation against the
    starting weights (or --ref-model), simpo = reference-free SimPO and orpo = ORPO (NLL plus
    odds ratio, no reference), all on pairwise shards; grpo and ppo = online RL on a prompt file,
    rollouts from the engine (docs/alignment.md)."""
    dpo_beta: float = 0.1
    """--stage dpo: β, the strength of the pull towards the reference (IPO's τ for ipo)."""
    dpo_loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """--stage dpo: the loss (trl's names): sigmoid (DPO), ipo, hinge (SLiC), robust (rDPO)."""
    dpo_label_smoothing: float = 0.0
    """--stage dpo: ε in [0, 0.5), the assumed share of flipped labels (sigmoid: conservative
    DPO; robust: rDPO)."""
    ref_model: str | None = None
    """--stage dpo: the reference's checkpoint directory (a trainer --save directory or a step in
    it; default: the weights the run starts from, or a LoRA policy's base)."""
    simpo_beta: float = 2.5
    """--stage simpo: β, the scale of the length-normalised log-probability margin."""
    gamma_beta_ratio: float = 1.4
    """--stage simpo: γ/β, the target margin γ as a multiple of --simpo-beta."""
    orpo_beta: float = 0.1
    """--stage orpo: β (the paper's λ), the weight of the odds-ratio term beside the NLL."""

    def __post_init__(self) -> None:
        if self.train_iters <= 0:
            raise ValueError(f"--train-iters must be positive, got {self.train_iters}")
        if self.exit_interval < 0 or self.exit_duration_in_mins < 0:
            raise ValueError(
                f"--exit-interval ({self.exit_interval}) and --exit-duration-in-mins "
                f"({self.exit_duration_in_mins}) must be >= 0 (0 disables them)"
            )
        for stage, settings in (
            (
                "dpo",
                (
                    ("--dpo-beta", self.dpo_beta, 0.1),
                    ("--dpo-loss-type", self.dpo_loss_type, "sigmoid"),
                    ("--dpo-label-smoothing", self.dpo_label_smoothing, 0.0),
                    ("--ref-model", self.ref_model, None),
                ),
            ),
            (
                "simpo",
                (
                    ("--simpo-beta", self.simpo_beta, 2.5),
                    ("--gamma-beta-ratio", self.gamma_beta_ratio, 1.4),
                ),
            ),
            ("orpo", (("--orpo-beta", self.orpo_beta, 0.1),)),
        ):
            changed = [flag for flag, value, default in settings if value != default]
            if changed and self.stage != stage:
                raise ValueError(
                    f"{', '.join(changed)} only apply to --stage {stage} (this run is --stage "
                    f"{self.stage}); drop them or pass --stage {stage}"
                )
        if self.profile_step_start < 0 or self.profile_step_end <= self.profile_step_start:
            raise ValueError(
                f"--profile-step-start {self.profile_step_start} and --profile-step-end "
                f"{self.profile_step_end}: need 0 <= start < end (steps start .. end-1 are "
                "profiled)"
            )
        if not self.profile_ranks or any(r < -1 for r in self.profile_ranks):
            raise ValueError(
                f"--profile-ranks {self.profile_ranks}: give global ranks, or -1 for every rank"
            )
        for name in ("eval_interval", "eval_iters", "save_interval", "keep_last_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag_name(name)} must be >= 0, got {getattr(self, name)}")
        if self.log_interval <= 0:
            raise ValueError(f"--log-interval must be positive, got {self.log_interval}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.save_interval and not self.save:
            raise ValueError("--save-interval needs --save DIR (where to write checkpoints)")
        if (
            self.no_load_optim
            or self.no_load_rng
            or self.finetune
            or self.exit_on_missing_checkpoint
        ) and not self.load:
            raise ValueError(
                "--no-load-optim/--no-load-rng/--finetune/--exit-on-missing-checkpoint need --load DIR"
            )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {self.peak_tflops}")

    def profile_dir(self) -> str:
        """Where --profile writes its traces: --profile-save-path, else `profile/` in the log dir,
        else ./profile_dir (MindSpeed's default)."""
        if self.profile_save_path:
            return self.profile_save_path
        if self.log_dir:
            return os.path.join(self.log_dir, "profile")
        return "profile_dir"

    def profiles_rank(self, rank: int) -> bool:
        """Whether --profile records global rank `rank`."""
        return self.profile and (-1 in self.profile_ranks or rank in self.profile_ranks)


@dataclass
class ParallelSection:
    """Data, tensor, sequence, pipeline and context parallelism, and activation recompute."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1; same as --zero-stage 1)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """0: DDP, 1: sharded optimizer state, 2: + sharded grads (FSDP2), 3: + sharded params."""
    hsdp: bool = False
    """Hybrid sharding: shard within groups of --hsdp-shard-size ranks, replicate across them."""
    hsdp_shard_size: int = 0
    """Data-parallel ranks per HSDP shard group (0: the data-parallel ranks of one node, as FSDP's
    HYBRID_SHARD; all of them when the launcher's processes per node are unknown)."""
    cpu_offload: bool = False
    """Keep sharded parameters, grads and optimizer state on the CPU (ZeRO-3)."""
    optimizer_cpu_offload: bool = False
    """Keep AdamW's states (m, v) and its step on the CPU (ZeRO-Offload, DeepSpeed's
    offload_optimizer; Megatron's flag), under any --zero-stage; needs --optimizer adam/adamw."""
    optimizer_nvme_path: str | None = None
    """With --optimizer-cpu-offload: hold the optimizer states in swap files in this local
    directory, streamed through bounded host buffers at each step (ZeRO-Infinity's NVMe tier)."""
    param_nvme_path: str | None = None
    """With --cpu-offload and --optimizer-cpu-offload (ZeRO-3): hold each rank's parameter shards
    in a swap file in this local directory, read into bounded host buffers just before each
    layer's all-gather (ZeRO-Infinity's offload_param to NVMe)."""
    param_nvme_buffer_count: int = 5
    """With --param-nvme-path: host buffers the shards are read into (each the size of the largest
    layer's shards): the layer being gathered and up to N-1 layers read ahead (DeepSpeed's
    offload_param buffer_count; its default, models.model_states.PARAM_SWAP_BUFFER_COUNT, spelt
    out to keep this module torch-free)."""
    offload_pin_memory: bool = False
    """Pin the host buffers of --cpu-offload and --optimizer-cpu-offload where an accelerator
    exists (faster copies); a CPU run makes no host-device copies, so it changes nothing there."""
    overlap_grad_reduce: bool = False
    """Under pipeline parallelism: reduce a stage's gradients as soon as its last micro-batch
    backward is done (overlapping the rest of the schedule), not after the whole schedule."""
    zero3_prefetch_layers: int = 0
    """ZeRO-3: all-gather the next N layers' parameters ahead of use in forward and backward
    (FSDP2 explicit prefetch); 0 keeps FSDP2's default of one layer ahead in backward."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in tensor-parallel regions."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage (interleaved 1F1B)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers of the first pipeline stage (it also holds the embedding); the others split the
    rest evenly (Megatron's flag; e.g. BLOOM-176B's 70 layers over 12 stages: 5, 6 x 10, 5)."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers of the last pipeline stage (it also holds the final norm, head and loss)."""
    context_parallel_size: int = 1
    """Context-parallel (ring attention) size."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size: MoE experts split over this many data-parallel ranks (must divide
    the data-parallel size and --num-experts)."""
    pipeline_schedule: (
        Literal[
            "1f1b",
            "gpipe",
            "interleaved_1f1b",
            "looped_bfs",
            "interleaved_zero_bubble",
            "zbv",
            "dualpipev",
        ]
        | None
    ) = None
    """Pipeline schedule (default: 1f1b, or interleaved_1f1b with virtual stages; zbv and
    dualpipev need 2 virtual chunks per rank)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recompute granularity."""
    recompute_method: Literal["uniform", "block"] | None = None
    """How layers are grouped for full recompute."""
    recompute_num_layers: int | None = None
    """Layers per recompute group (uniform) or recomputed layers per stage (block)."""
    compile: bool = False
    """torch.compile each decoder layer (after TP and recompute, before FSDP): fused kernels, fewer
    launches; the first steps pay the compile time (about a minute per distinct layer on CPU)."""
    auto_recompute_device_size: int | None = None
    """Adaptive recompute: device memory budget in MB; profile, then recompute layers to fit it."""
    auto_recompute_profiling_step: int = 10
    """Adaptive recompute: steps profiled before the plan is chosen (at least 5)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.use_distributed_optimizer:
            if self.zero_stage not in (0, 1):
                raise ValueError(
                    f"--use-distributed-optimizer means ZeRO-1 but --zero-stage is {self.zero_stage}; give one"
                )
            self.zero_stage = 1
        self._check_offload()
        if self.overlap_grad_reduce and self.pipeline_model_parallel_size < 2:
            warnings.warn(
                "--overlap-grad-reduce applies under --pipeline-model-parallel-size > 1; ignored",
                stacklevel=2,
            )
        if self.zero3_prefetch_layers < 0:
            raise ValueError(
                f"--zero3-prefetch-layers must be >= 0, got {self.zero3_prefetch_layers}"
            )
        if self.zero3_prefetch_layers and self.zero_stage != 3:
            raise ValueError(
                "--zero3-prefetch-layers needs --zero-stage 3 (only ZeRO-3 gathers parameters "
                f"per layer), got --zero-stage {self.zero_stage}"
            )
        if self.hsdp_shard_size < 0:
            raise ValueError(f"--hsdp-shard-size must be >= 0, got {self.hsdp_shard_size}")
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        self._check_recompute()
        self._check_pipeline_split()

    def _check_offload(self) -> None:
        """The offload and sharding flags need the ZeRO stage and partners they act with."""
        if self.cpu_offload and self.zero_stage != 3:
            raise ValueError(
                "--cpu-offload needs --zero-stage 3 (offloading works on sharded parameters)"
            )
        if self.hsdp and self.zero_stage < 2:
            raise ValueError("--hsdp needs --zero-stage 2 or 3 (it shards within groups)")
        if self.optimizer_nvme_path and not self.optimizer_cpu_offload:
            raise ValueError(
                "--optimizer-nvme-path holds the offloaded optimizer's states: add "
                "--optimizer-cpu-offload (the step runs on the CPU)"
            )
        if self.param_nvme_path and not (self.cpu_offload and self.optimizer_cpu_offload):
            raise ValueError(
                "--param-nvme-path holds ZeRO-3's parameter shards: add --cpu-offload (shards on "
                "the host, --zero-stage 3) and --optimizer-cpu-offload (the step reads and writes "
                "them on the CPU)"
            )
        if self.param_nvme_buffer_count < 1 or (
            self.param_nvme_buffer_count != 5 and not self.param_nvme_path
        ):
            raise ValueError(
                f"--param-nvme-buffer-count {self.param_nvme_buffer_count}: give 1 or more, with "
                "--param-nvme-path (it sizes that tier's read-ahead)"
            )
        if self.param_nvme_path and (
            self.model_parallel_size() > 1 or self.expert_model_parallel_size > 1
        ):
            raise ValueError(
                "--param-nvme-path offloads ZeRO-3's data-parallel shards only: drop tensor, "
                "pipeline, context and expert parallelism (sizes 1) or drop --param-nvme-path"
            )
        if self.offload_pin_memory and not (self.cpu_offload or self.optimizer_cpu_offload):
            raise ValueError(
                "--offload-pin-memory pins offloaded tensors: add --cpu-offload (ZeRO-3) or "
                "--optimizer-cpu-offload, or drop it"
            )

    def _check_pipeline_split(self) -> None:
        """Uneven first/last stages and virtual stages need a pipeline (and not both)."""
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            if value < 0:
                raise ValueError(f"{flag_name(name)} must be >= 0, got {value}")
            if self.pipeline_model_parallel_size < 2:
                raise ValueError(f"{flag_name(name)} needs --pipeline-model-parallel-size >= 2")
            if self.num_layers_per_virtual_pipeline_stage is not None:
                raise ValueError(
                    f"{flag_name(name)} sets uneven stages, which interleaved virtual stages do not "
                    "take; drop --num-layers-per-virtual-pipeline-stage or the uneven split"
                )
        if (
            self.num_layers_per_virtual_pipeline_stage is not None
            and self.pipeline_model_parallel_size < 2
        ):
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2"
            )

    def _check_recompute(self) -> None:
        if self.auto_recompute_device_size is None:
            return
        if self.compile:
            raise ValueError(
                "--auto-recompute-device-size rewraps layers after profiling, which would "
                "discard --compile's graphs; use --recompute-granularity with --compile"
            )
        if self.recompute_granularity is not None:
            raise ValueError(
                "--auto-recompute-device-size chooses the recomputed layers itself; drop "
                "--recompute-granularity (or the budget)"
            )
        if self.auto_recompute_device_size <= 0:
            raise ValueError(
                f"--auto-recompute-device-size must be positive MB, got "
                f"{self.auto_recompute_device_size}"
            )
        if self.auto_recompute_profiling_step < 5:
            raise ValueError(
                f"--auto-recompute-profiling-step must be >= 5, got "
                f"{self.auto_recompute_profiling_step}"
            )

    def model_parallel_size(self) -> int:
        """Ranks that share one model replica (tensor x pipeline x context)."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
