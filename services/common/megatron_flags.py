"""Megatron-LM / ModelLink flags that are not Meshline config fields: the table, as data.

Every flag of ModelLink's README scripts and Megatron-LM's GPT/Llama pretraining examples is
either a training field (`arguments.field_index()`, same name and meaning) or one row here:

- `map`: accepted and translated onto fields (`--checkpoint-activations` -> full recompute);
- `same`: accepted, nothing to do: Meshline always behaves as the flag asks (fused kernels are
  chosen per device, the pipeline's send/recv are not overlapped, ...);
- `refuse`: an error of one line naming the Meshline equivalent.

`apply(given)` turns the parsed compat flags into field values (a mapped value that contradicts
an explicit flag is an error naming both). No row is accepted without effect (the decisions:
docs/decisions.md, "DeepSpeed configurations key by key; no Megatron/ModelLink flag without
effect").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.common import compat_flags
from services.common.compat_flags import DEST_PREFIX, SAME_KERNEL, CompatFlag, same_rows
from training import deepspeed_config


def _recompute_policy(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if value == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform"}
    if value == "block":
        return {"recompute_granularity": "full", "recompute_method": "block"}
    raise ValueError(
        f"--checkpoint-policy {value}: use --checkpoint-policy full/block, or "
        "--recompute-granularity selective (Meshline's per-op policy) instead of custom"
    )


def _data_impl(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if value in ("mmap", "infer"):
        return {"data_format": "mmap" if value == "mmap" else "auto"}
    raise ValueError(
        f"--data-impl {value}: Meshline reads mmap .bin/.idx shards (or Arrow); re-run "
        "`meshline preprocess` to write mmap shards and pass --data-impl mmap"
    )


def _per_batch(flag: str, field: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    def convert(value: Any, given: dict[str, Any]) -> dict[str, Any]:
        gbs = given.get("global_batch_size")
        if not gbs:
            raise ValueError(
                f"{flag} counts samples; give --global-batch-size too (iterations = samples / "
                f"global batch), or use --{field.replace('_', '-')}"
            )
        return {field: max(1, -(-int(value) // int(gbs)))}

    return convert


def _zero_only(flag: str, use: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """A value flag whose 0 is Meshline's behaviour; other values are refused."""

    def convert(value: Any, given: dict[str, Any]) -> dict[str, Any]:
        if str(value) in ("0", "0.0"):
            return {}
        raise ValueError(f"{flag} {value} is not supported: {use}")

    return convert


def _rotary_percent(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if float(value) != 1.0:
        raise ValueError(
            f"--rotary-percent {value}: Meshline rotates the whole head (1.0); partial rotary "
            "embeddings are not supported"
        )
    return {}


def _virtual_stages(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    layers, pp = given.get("num_layers"), given.get("pipeline_model_parallel_size", 1)
    if not layers or int(layers) % (int(pp) * int(value)):
        raise ValueError(
            f"--virtual-pipeline-model-parallel-size {value}: give --num-layers divisible by "
            "pipeline x virtual size, or use --num-layers-per-virtual-pipeline-stage"
        )
    return {"num_layers_per_virtual_pipeline_stage": int(layers) // (int(pp) * int(value))}


def _fp8_format(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    """Megatron's switch for FP8 training: e4m3 everywhere, or hybrid (e5m2 gradients)."""
    recipe = given.get("fp8") or "tensorwise"
    if value not in ("e4m3", "hybrid"):
        raise ValueError(f"--fp8-format {value} is not supported: use e4m3 or hybrid")
    if value == "hybrid" and recipe == "rowwise":
        raise ValueError(
            "--fp8-format hybrid encodes gradients in e5m2, which --fp8 rowwise does not take: "
            "use --fp8-format e4m3 with --fp8 rowwise, or --fp8 tensorwise"
        )
    return {"fp8": recipe, "fp8_grad_format": "e5m2" if value == "hybrid" else "e4m3"}


def _fp8_recipe(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if value == "tensorwise":
        return {"fp8": "tensorwise"}
    nearest = {
        "delayed": "Meshline scales each tensor by its current amax (dynamic scaling): use "
        "--fp8-recipe tensorwise or --fp8 tensorwise",
        "mxfp8": "no MX block scaling; the nearest is per-row scaling: --fp8 rowwise",
        "blockwise": "no block scaling; the nearest is per-row scaling: --fp8 rowwise",
    }.get(str(value), "use --fp8 tensorwise or --fp8 rowwise")
    raise ValueError(f"--fp8-recipe {value} is not supported: {nearest}")


def _fp8_history(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if str(value) == "1":
        return {}
    raise ValueError(
        f"--fp8-amax-history-len {value} is not supported: Meshline scales each tensor by its "
        "current amax (dynamic scaling, a history of 1); pass 1 or drop the flag"
    )


def _fp8_algo(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if value in ("max", "most_recent"):
        return {}
    raise ValueError(f"--fp8-amax-compute-algo {value} is not supported: use max or most_recent")


_FP8_ROWS = ("--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-margin")
"""Rows that tune FP8 training without turning it on."""
_FP8_SCALING = (
    "dynamic scaling: each tensor's current amax, so over a history of 1 (the only length) max "
    "and most_recent agree"
)
_NO_FUSION = (
    "kernel fusion is chosen per device by kernels/; fused and reference kernels agree within "
    "rounding (MESHLINE_KERNELS=reference forces the reference ones)"
)
_LOGGING = "Meshline logs loss, lr, grad norm and tokens/s to --log-dir (metrics.csv, TensorBoard)"

TABLE: tuple[CompatFlag, ...] = (
    # --- recompute and attention
    CompatFlag("--checkpoint-activations", "map", "full activation recompute of every layer",
               sets=(("recompute_granularity", "full"), ("recompute_method", "uniform"))),
    CompatFlag("--checkpoint-policy", "map", "full -> full recompute, block -> "
               "--recompute-method block", nargs=1, convert=_recompute_policy),
    CompatFlag("--checkpoint-block-layer", "map", "--recompute-num-layers", nargs=1,
               convert=lambda v, g: {"recompute_num_layers": int(v)}),
    CompatFlag("--triangle-attn", "map", "--attention-backend blockwise (skips blocks above "
               "the causal diagonal)", sets=(("attention_backend", "blockwise"),)),
    CompatFlag("--use-flash-attn", "map", "--attention-backend auto: the device's flash kernel "
               "(flash-attn on CUDA, npu_fusion_attention on NPU, sdpa on CPU)",
               sets=(("attention_backend", "auto"),)),
    CompatFlag("--use-rotary-position-embeddings", "map", "--position-embedding-type rope",
               sets=(("position_embedding_type", "rope"),)),
    CompatFlag("--rotary-percent", "map", "1.0 only (whole-head rotary)", nargs=1,
               convert=_rotary_percent),
    *same_rows(SAME_KERNEL, "--use-fused-rmsnorm", "--use-fused-rotary-pos-emb",
               "--use-fused-swiglu"),
    CompatFlag("--mlp-layer-fusion", "same", "gate and up projections are one fused GEMM "
               "(gate_up_proj) in every gated model"),
    CompatFlag("--attention-softmax-in-fp32", "same", "attention softmax is computed in fp32"),
    CompatFlag("--accumulate-allreduce-grads-in-fp32", "same", "gradients are fp32 masters"),
    CompatFlag("--use-mcore-models", "same", "one model implementation (models/)"),
    CompatFlag("--transformer-impl", "same", "one model implementation (models/)", nargs=1),
    CompatFlag("--no-create-attention-mask-in-dataloader", "same", "masks are built per kernel"),
    CompatFlag("--use-cpu-initialization", "same", "weights are initialised deterministically "
               "from --seed on any device"),
    CompatFlag("--no-overlap-p2p-communication", "same", "pipeline send/recv are not overlapped"),
    CompatFlag("--lora-register-forward-hook", "same", "pipeline stages keep the gradient "
               "chain of LoRA runs without hooks", nargs="*"),
    CompatFlag("--exit-signal-handler", "same", "SIGTERM ends the run at a step boundary and "
               "saves when --save is given"),
    CompatFlag("--distributed-backend", "same", "nccl/hccl/gloo are chosen per device", nargs=1),
    CompatFlag("--DDP-impl", "same", "data parallelism is torch DDP/FSDP2 (--zero-stage)",
               nargs=1),
    CompatFlag("--local-rank", "same", "torchrun's environment gives the rank", nargs=1,
               aliases=("--local_rank",)),
    CompatFlag("--use-dist-ckpt", "same", "checkpoints are torch.distributed.checkpoint"),
    CompatFlag("--ckpt-format", "same", "checkpoints are torch.distributed.checkpoint; "
               "`meshline convert` reads and writes Megatron's torch format", nargs=1),
    CompatFlag("--log-throughput", "same", _LOGGING),
    # --- data and schedule
    CompatFlag("--data-impl", "map", "--data-format mmap (infer -> auto)", nargs=1,
               convert=_data_impl, aliases=("--dataset-impl",)),
    CompatFlag("--train-samples", "map", "--train-iters = samples / --global-batch-size",
               nargs=1, convert=_per_batch("--train-samples", "train_iters")),
    CompatFlag("--lr-decay-samples", "map", "--lr-decay-iters = samples / --global-batch-size",
               nargs=1, convert=_per_batch("--lr-decay-samples", "lr_decay_iters")),
    CompatFlag("--lr-warmup-samples", "map", "--lr-warmup-iters = samples / "
               "--global-batch-size", nargs=1,
               convert=_per_batch("--lr-warmup-samples", "lr_warmup_iters")),
    CompatFlag("--pad-vocab-size-to", "map", "--vocab-size", nargs=1,
               convert=lambda v, g: {"vocab_size": int(v)}),
    CompatFlag("--virtual-pipeline-model-parallel-size", "map", "--num-layers-per-virtual-"
               "pipeline-stage = layers / (pipeline x virtual)", nargs=1, convert=_virtual_stages),
    # --- DeepSpeed (ModelLink's deepspeed branch)
    CompatFlag("--deepspeed", "same", "ZeRO is built in: --zero-stage N, or --deepspeed-config "
               "whose keys are mapped one by one"),
    CompatFlag("--deepspeed-config", "map", "every key mapped or refused by name "
               "(docs/training.md, DeepSpeed configurations)", nargs=1,
               convert=deepspeed_config.convert, aliases=("--deepspeed_config",),
               reads_file=True),
    CompatFlag("--deepspeed-activation-checkpointing", "same", "recompute uses Meshline's "
               "checkpointing; --checkpoint-activations turns it on"),
    CompatFlag("--partition-activations", "refuse", "use --sequence-parallel to shard "
               "activations over tensor-parallel ranks"),
    # --- performance options of other runtimes
    CompatFlag("--optimized-pipeline", "refuse", "per-stage micro-batch sizes are not "
               "implemented; use --micro-batch-size (one size for every stage)"),
    CompatFlag("--manual-mbs", "refuse", "per-stage micro-batch sizes are not implemented; use "
               "--micro-batch-size", nargs=1),
    CompatFlag("--fold-mode", "refuse", "Fold3D is not implemented; use --overlap-grad-reduce "
               "(a stage's gradient reduction overlaps the rest of the schedule)", nargs=1),
    CompatFlag("--use-mc2", "refuse", "Ascend's fused matmul + collective is not used; drop "
               "the flag"),
    CompatFlag("--reuse-fp32-param", "refuse", "use --release-fp32-grad to drop the persistent "
               "fp32 gradient copy"),
    CompatFlag("--jit-compile", "refuse", "use --compile (torch.compile per decoder layer)"),
    CompatFlag("--overlap-param-gather", "refuse", "use --zero-stage 3 --zero3-prefetch-layers "
               "N (FSDP2 gathers parameters ahead of use)"),
    CompatFlag("--overlap-p2p-communication", "refuse", "pipeline send/recv are not "
               "overlapped; drop the flag"),
    CompatFlag("--grad-reduce-in-bf16", "refuse", "gradients are reduced in fp32; drop the "
               "flag"),
    *same_rows(_NO_FUSION, "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
               "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
               "--no-gradient-accumulation-fusion", "--cross-entropy-loss-fusion",
               "--no-async-tensor-model-parallel-allreduce"),
    CompatFlag("--fp16-lm-cross-entropy", "refuse", "the cross entropy is computed in fp32; "
               "drop the flag"),
    CompatFlag("--calculate-per-token-loss", "same", "the loss is already the mean over "
               "every counted token of the global batch"),
    CompatFlag("--no-shared-storage", "same", "each node builds its own index cache"),
    CompatFlag("--num-workers", "map", "0 only: samples are read in the training process "
               "from memory-mapped shards", nargs=1,
               convert=_zero_only("--num-workers", "samples are read in the training process "
                                  "from memory-mapped shards; drop the flag")),
    CompatFlag("--manual-gc", "refuse", "Python's automatic garbage collection runs; drop "
               "the flag"),
    CompatFlag("--manual-gc-interval", "map", "0 only (automatic garbage collection)", nargs=1,
               convert=_zero_only("--manual-gc-interval", "Python's automatic garbage "
                                  "collection runs; drop the flag")),
    CompatFlag("--empty-unused-memory-level", "map", "0 only: the caching allocator keeps "
               "freed blocks", nargs=1,
               convert=_zero_only("--empty-unused-memory-level", "the caching allocator keeps "
                                  "freed blocks; drop the flag")),
    CompatFlag("--distributed-timeout-minutes", "refuse", "the process group uses PyTorch's "
               "default timeout; drop the flag", nargs=1),
    CompatFlag("--no-check-for-nan-in-loss-and-grad", "refuse", "a non-finite loss stops the "
               "run (--nan-policy stop) or skips the step: use --nan-policy skip"),
    # --- logging and profiling
    CompatFlag("--log-params-norm", "refuse", _LOGGING),
    CompatFlag("--log-num-zeros-in-grad", "refuse", _LOGGING),
    CompatFlag("--log-timers-to-tensorboard", "refuse", "use --profile (a torch.profiler "
               "trace); " + _LOGGING),
    CompatFlag("--log-validation-ppl-to-tensorboard", "same", "validation loss and perplexity "
               "are written to TensorBoard (val/loss, val/ppl) under --log-dir"),
    CompatFlag("--log-memory-to-tensorboard", "refuse", "use --profile --profile-with-memory; "
               + _LOGGING),
    CompatFlag("--log-batch-size-to-tensorboard", "refuse", _LOGGING),
    CompatFlag("--timing-log-level", "map", "0 only: the metrics line has the step time",
               nargs=1, convert=_zero_only("--timing-log-level", "use --profile for per-op "
                                           "timings; " + _LOGGING)),
    CompatFlag("--tensorboard-log-interval", "map", "--log-interval (TensorBoard is written "
               "with every metrics line)", nargs=1,
               convert=lambda v, g: {"log_interval": int(v)}),
    CompatFlag("--tensorboard-queue-size", "refuse", "TensorBoard's writer queue is not "
               "configurable; drop the flag", nargs=1),
    CompatFlag("--wandb-project", "refuse", "Weights & Biases is not supported; " + _LOGGING,
               nargs=1),
    CompatFlag("--wandb-exp-name", "refuse", "Weights & Biases is not supported; " + _LOGGING,
               nargs=1),
    CompatFlag("--use-pytorch-profiler", "same", "--profile always runs torch.profiler "
               "(torch_npu's on Ascend); on CUDA it also opens the cudaProfilerApi range nsys "
               "captures"),
    CompatFlag("--use-checkpoint-args", "refuse", "the model comes from the flags or --model; "
               "give them (checkpoints hold model_config.json for `meshline convert`)"),
    # --- refused: no equivalent behaviour
    CompatFlag("--vocab-file", "refuse", "use --tokenizer-type PretrainedFromHF "
               "--tokenizer-name-or-path DIR (a HF tokenizer directory)", nargs=1),
    CompatFlag("--merge-file", "refuse", "use --tokenizer-type PretrainedFromHF "
               "--tokenizer-name-or-path DIR (a HF tokenizer directory)", nargs=1),
    CompatFlag("--decoupled-lr", "refuse", "one learning rate for every parameter: --lr",
               nargs=1),
    CompatFlag("--decoupled-min-lr", "refuse", "one learning rate for every parameter: "
               "--min-lr", nargs=1),
    CompatFlag("--apply-layernorm-1p", "refuse", "norm weights are plain (not 1 + w); drop "
               "the flag (convert such checkpoints with `meshline convert`)"),
    # --- FP8 (training/fp8.py): each needs FP8 training on (checked in apply)
    CompatFlag("--fp8-format", "map", "e4m3 -> --fp8 tensorwise --fp8-grad-format e4m3, hybrid "
               "-> --fp8 tensorwise (e5m2 gradients); scaling is dynamic, not delayed",
               nargs=1, convert=_fp8_format),
    CompatFlag("--fp8-recipe", "map", "tensorwise -> --fp8 tensorwise; delayed, mxfp8 and "
               "blockwise are refused naming the nearest", nargs=1, convert=_fp8_recipe),
    CompatFlag("--fp8-amax-history-len", "map", "1 only: " + _FP8_SCALING, nargs=1,
               convert=_fp8_history),
    CompatFlag("--fp8-amax-compute-algo", "map", "max or most_recent: " + _FP8_SCALING,
               nargs=1, convert=_fp8_algo),
    CompatFlag("--fp8-margin", "map", "0 only: scales are the largest power of two that keeps "
               "the amax representable", nargs=1,
               convert=_zero_only("--fp8-margin", "scales are the largest power of two that keeps "
                                  "the amax representable; pass 0 or drop the flag")),
    CompatFlag("--fp8-param-gather", "refuse", "parameters are gathered in their training "
               "dtype; --fp8 makes FP8 copies inside each matmul: drop the flag"),
)  # fmt: skip

# Other spellings of training fields.
FIELD_ALIASES: dict[str, str] = {
    "--layernorm-epsilon": "norm_epsilon",
    "--tensorboard-dir": "log_dir",
    "--num-kv-heads": "num_query_groups",
}


def by_flag() -> dict[str, CompatFlag]:
    """Every spelling -> its row."""
    return compat_flags.by_flag(TABLE, "Megatron")


def add_flags(parser: Any) -> None:
    """Add every row to an argparse parser (values land under `megatron__<name>`)."""
    compat_flags.add_rows(
        parser,
        TABLE,
        "Megatron/ModelLink compatibility",
        "accepted for unchanged scripts (docs/coming-from-modellink.md)",
    )


def apply(given: dict[str, Any], *, read_files: bool = False) -> dict[str, Any]:
    """Resolve compat flags in parsed `given` values into field values.

    `given` holds field values plus `megatron__*` entries; the latter are removed, refused flags
    raise ValueError naming the equivalent, and a mapped value that contradicts an explicit flag
    raises ValueError naming both. Flags whose value is a file to read (--deepspeed-config) are
    refused unless `read_files` (the command line; a service request's paths are untrusted).
    """
    rows = {row.dest: row for row in TABLE}
    values = {k: v for k, v in given.items() if not k.startswith(DEST_PREFIX)}
    explicit = dict(values)
    origin: dict[str, str] = {}  # field -> the compat flag that set it
    for dest in [k for k in given if k.startswith(DEST_PREFIX)]:
        row, value = rows[dest], given[dest]
        if row.kind == "refuse":
            raise ValueError(f"{row.flag} is not supported: {row.note}")
        if row.kind == "same":
            continue
        if row.reads_file and not read_files:
            raise ValueError(
                f"{row.flag} names a file, which only the `meshline train` command line reads; "
                "give its settings as flags (--zero-stage N, --bf16, --micro-batch-size)"
            )
        mapped = dict(row.sets) if row.convert is None else row.convert(value, values)
        for field, new in mapped.items():
            if field in explicit and explicit[field] != new:
                flag = "--" + field.replace("_", "-")
                raise ValueError(
                    f"{row.flag} means {flag} {new} but {flag} {explicit[field]} is also given; "
                    "drop one of them"
                )
            values[field] = new
            origin[field] = row.flag
    fp8_rows = [rows[dest].flag for dest in given if dest in rows and rows[dest].flag in _FP8_ROWS]
    if fp8_rows and values.get("fp8") is None:
        raise ValueError(
            f"{fp8_rows[0]} sets how FP8 training scales, but FP8 training is off: add --fp8 "
            "tensorwise|rowwise (or Megatron's --fp8-format hybrid), or drop the flag"
        )
    if "auto_recompute_device_size" in values and "recompute_granularity" in origin:
        raise ValueError(
            f"{origin['recompute_granularity']} and --auto-recompute-device-size are exclusive: "
            f"the adaptive recompute chooses the layers itself; drop "
            f"{origin['recompute_granularity']}"
        )
    return values
