"""`meshline estimate`: per-device training memory for a model × parallel layout.

    meshline estimate --model llama2-7B --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --world-size 16 --zero-stage 1 --bf16 \
        --recompute-granularity selective --micro-batch-size 1 --seq-length 4096

Prints one row per pipeline rank kind (first / middle / last stage) with parameters, gradients,
optimizer states, activations and their total, in the spirit of DeepSpeed's
`estimate_zero3_model_states_mem_needs`. Formulas: `models/memory.py`; the model-state bytes
are the counting `meshline train --dry-run` checks on the built model, rank by rank.

    meshline estimate --model llama2-70B --auto --world-size 64 --device-memory 64GiB \
        --global-batch-size 512 --seq-length 4096

ranks the layouts that fit (TP, PP, virtual PP, DP/ZeRO, recompute, micro-batch) by the cost
model of `models/auto_config.py` and prints the `meshline train` command of the best. With
`--trial N` (and the training flags: data, ...) the top N are measured by short training runs
and the fastest that fits is picked: `services/estimate_trial.py`, where `meshline`
routes that command line (this library launches nothing).

    meshline estimate --model llama2-7B --zero-stage 3 --world-size 16 --devices-per-node 8 \
        --bf16 --deepspeed-estimate

adds DeepSpeed's own model-state table for the same model and devices
(`estimate_zero3_model_states_mem_needs_all_cold`: every offload choice, bytes equal to
DeepSpeed's; `models/deepspeed_estimate.py`), the row of the given offload flags marked.
"""

from __future__ import annotations

import argparse
import sys

from models.accounting import count_parameters, format_count
from models.auto_config import Hardware, candidates, command_line
from models.config import ModelConfig
from models.deepspeed_estimate import DEFAULT_BUFFER_FACTOR, ModelCounts, model_counts, table
from models.memory import RECOMPUTE, DeviceEstimate, TrainingLayout, estimate, parse_bytes
from models.model_states import OPTIMIZER_STATE_BYTES
from models.registry import get_config, list_configs


def build_parser() -> argparse.ArgumentParser:
    """Flags with Megatron/ModelLink names."""
    parser = argparse.ArgumentParser(
        prog="meshline estimate", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--model", choices=list_configs(), help="registered model config")
    size = parser.add_argument_group("model size (instead of, or overriding, --model)")
    size.add_argument("--num-layers", type=int)
    size.add_argument("--hidden-size", type=int)
    size.add_argument("--ffn-hidden-size", type=int)
    size.add_argument("--num-attention-heads", type=int)
    size.add_argument("--num-query-groups", type=int, help="KV heads (GQA)")
    size.add_argument("--vocab-size", type=int)
    _add_layout_flags(parser)
    ds = parser.add_argument_group("DeepSpeed's estimate (--deepspeed-estimate)")
    ds.add_argument(
        "--deepspeed-estimate",
        action="store_true",
        help="also print DeepSpeed's estimate_zero2/3_model_states_mem_needs table "
        "(--zero-stage 2 or 3, data parallelism only; nodes = world size / --devices-per-node)",
    )
    ds.add_argument(
        "--additional-buffer-factor",
        type=float,
        help=f"DeepSpeed's host-buffer factor (default {DEFAULT_BUFFER_FACTOR})",
    )
    run = parser.add_argument_group("run shape")
    run.add_argument("--recompute-granularity", choices=RECOMPUTE, default="none")
    run.add_argument("--micro-batch-size", type=int, default=1)
    run.add_argument("--seq-length", type=int, default=2048)
    run.add_argument("--no-flash-attention", action="store_true", help="store s×s scores")
    run.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="adamw",
        help="optimizer (state bytes per element)",
    )  # fmt: skip
    run.add_argument("--release-fp32-grad", action="store_true")
    _add_auto_flags(parser)
    prec = run.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp16", action="store_true")
    return parser


def _add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """The parallel layout and offload flags (what --auto chooses itself)."""
    par = parser.add_argument_group("parallel layout")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    par.add_argument("--data-parallel-size", type=int, help="default: world size / (TP·PP)")
    par.add_argument("--world-size", type=int, help="total devices (default TP·PP·DP)")
    par.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument(
        "--cpu-offload",
        action="store_true",
        help="ZeRO-3: parameters, gradients and optimizer states in host memory",
    )
    par.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="AdamW's moments and step on the host (DeepSpeed's offload_optimizer)",
    )
    par.add_argument(
        "--optimizer-nvme",
        action="store_true",
        help="with --optimizer-cpu-offload: the moments in NVMe swap files "
        "(meshline train --optimizer-nvme-path)",
    )
    par.add_argument(
        "--param-nvme",
        action="store_true",
        help="with --cpu-offload and --optimizer-cpu-offload: ZeRO-3's parameter shards in an "
        "NVMe swap file (meshline train --param-nvme-path)",
    )


def _add_auto_flags(parser: argparse.ArgumentParser) -> None:
    """--auto's flags: the machine and the batch the ranking is for."""
    auto = parser.add_argument_group(
        "auto-configuration (--auto)",
        "--trial N: measure the top N layouts by short training runs "
        "(meshline estimate --auto --trial 1 --help)",
    )
    auto.add_argument("--auto", action="store_true", help="rank the layouts that fit")
    auto.add_argument("--device-memory", help="memory per device, e.g. 64GiB (needed by --auto)")
    auto.add_argument("--global-batch-size", type=int, help="sequences per step (default 8·DP)")
    auto.add_argument(
        "--devices-per-node",
        type=int,
        default=8,
        help="devices per node (--auto, --deepspeed-estimate)",
    )
    auto.add_argument("--peak-tflops", type=float, default=989.0, help="per-device 16-bit peak")
    auto.add_argument("--top", type=int, default=5, help="layouts to list")


def _config(args: argparse.Namespace) -> ModelConfig:
    overrides = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "ffn_hidden_size": args.ffn_hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "num_kv_heads": args.num_query_groups,
        "vocab_size": args.vocab_size,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.model:
        return get_config(args.model, **overrides)
    missing = [
        k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in overrides
    ]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        raise ValueError(f"give --model or the size flags; missing {flags}")
    overrides.setdefault("ffn_hidden_size", 4 * overrides["hidden_size"])
    return ModelConfig(**overrides)


def _layout(args: argparse.Namespace, config: ModelConfig) -> TrainingLayout:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = args.data_parallel_size
    if args.world_size is not None:
        if args.world_size % (tp * pp):
            raise ValueError(
                f"--world-size {args.world_size} is not a multiple of TP·PP = {tp * pp}"
            )
        implied = args.world_size // (tp * pp)
        if dp is not None and dp != implied:
            raise ValueError(
                f"--data-parallel-size {dp} contradicts --world-size {args.world_size} / "
                f"(TP·PP = {tp * pp}) = {implied}; give one of them"
            )
        dp = implied
    vp = 1
    if args.num_layers_per_virtual_pipeline_stage:
        per_rank = config.num_layers // pp
        if per_rank % args.num_layers_per_virtual_pipeline_stage:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
                f" does not divide the {per_rank} layers per pipeline rank"
            )
        vp = per_rank // args.num_layers_per_virtual_pipeline_stage
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return TrainingLayout(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp or 1,
        virtual_stages=vp,
        zero_stage=args.zero_stage,
        recompute=args.recompute_granularity,
        precision=precision,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        sequence_parallel=args.sequence_parallel,
        cpu_offload=args.cpu_offload,
        optimizer_offload=_optimizer_offload(args),
        param_nvme=_param_nvme(args),
        flash_attention=not args.no_flash_attention,
        optimizer=args.optimizer,
        release_fp32_grad=args.release_fp32_grad,
    )


def _optimizer_offload(args: argparse.Namespace) -> str | None:
    if args.optimizer_nvme and not args.optimizer_cpu_offload:
        raise ValueError(
            "--optimizer-nvme needs --optimizer-cpu-offload (the step runs on the CPU)"
        )
    if not args.optimizer_cpu_offload:
        return None
    return "nvme" if args.optimizer_nvme else "cpu"


def _param_nvme(args: argparse.Namespace) -> bool:
    if args.param_nvme and not (args.cpu_offload and args.optimizer_cpu_offload):
        raise ValueError(
            "--param-nvme needs --cpu-offload (ZeRO-3 shards on the host) and "
            "--optimizer-cpu-offload (the step reads and writes them on the CPU)"
        )
    return bool(args.param_nvme)


def _gib(n: float) -> str:
    return f"{n / 2**30:9.2f}"


def format_table(rows: list[DeviceEstimate]) -> str:
    """The per-device table (GiB)."""
    head = f"{'ranks':<14}{'params':>10}{'grads':>10}{'optim':>10}{'activ':>10}{'total':>10}"
    head += f"{'host':>10}{'nvme':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        values = (r.parameters, r.gradients, r.optimizer, r.activations, r.total, r.host, r.nvme)
        lines.append(f"{r.kind:<14}" + "".join(f" {_gib(v)}" for v in values))
    return "\n".join(lines)


def deepspeed_devices(layout: TrainingLayout, devices_per_node: int) -> tuple[int, int]:
    """(devices per node, nodes) of DeepSpeed's estimate for `layout` (data parallelism only)."""
    if layout.tensor_parallel > 1 or layout.pipeline_parallel > 1:
        raise ValueError(
            "--deepspeed-estimate covers ZeRO data parallelism alone (DeepSpeed's estimate has no "
            "tensor or pipeline split): drop --tensor-model-parallel-size and "
            "--pipeline-model-parallel-size"
        )
    if layout.zero_stage not in (2, 3):
        raise ValueError(
            f"--deepspeed-estimate: DeepSpeed estimates ZeRO-2 and ZeRO-3 only; give --zero-stage "
            f"2 or 3 (got {layout.zero_stage})"
        )
    if devices_per_node < 1:
        raise ValueError(f"--devices-per-node {devices_per_node}: must be >= 1")
    world = layout.data_parallel * layout.context_parallel
    per_node = min(devices_per_node, world)
    if world % per_node:
        raise ValueError(
            f"--deepspeed-estimate: {world} devices do not fill whole nodes of "
            f"--devices-per-node {devices_per_node}"
        )
    return per_node, world // per_node


def format_deepspeed(args: argparse.Namespace, counts: ModelCounts, layout: TrainingLayout) -> str:
    """DeepSpeed's model-state table for this model and these devices, the flags' row marked."""
    per_node, nodes = deepspeed_devices(layout, args.devices_per_node)
    factor = (
        DEFAULT_BUFFER_FACTOR
        if args.additional_buffer_factor is None
        else args.additional_buffer_factor
    )
    if factor <= 0:
        raise ValueError(f"--additional-buffer-factor {factor}: must be > 0 (DeepSpeed's is 1.5)")
    stage = layout.zero_stage
    rows = table(stage, counts, per_node, nodes, factor)
    offload_optimizer = layout.cpu_offload or layout.optimizer_offload == "cpu"
    lines = [
        f"DeepSpeed's estimate (estimate_zero{stage}_model_states_mem_needs_all_cold): "
        f"{nodes} node(s) x {per_node} device(s), {counts.total_params:,} parameters, "
        f"largest layer {counts.largest_layer_params:,}, additional_buffer_factor {factor}",
        f"{'per CPU GiB':>12} {'per GPU GiB':>12} {'per CPU bytes':>20} {'per GPU bytes':>20}  options",
    ]
    for row in rows:
        mine = (
            layout.optimizer_offload != "nvme"
            and not layout.param_nvme
            and row.offload_optimizer == offload_optimizer
            and (stage == 2 or (row.offload_param == layout.cpu_offload and row.zero_init))
        )
        lines.append(
            f"{row.cpu_bytes / 2**30:12.2f} {row.gpu_bytes / 2**30:12.2f} "
            f"{row.cpu_bytes:20d} {row.gpu_bytes:20d}  {row.options(stage)}"
            + ("   <- these flags" if mine else "")
        )
    if layout.optimizer_offload == "nvme" or layout.param_nvme:
        lines.append(
            "(DeepSpeed's estimate has no NVMe rows: --optimizer-nvme/--param-nvme match none)"
        )
    return "\n".join(lines)


AUTO_CHOSEN = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "data_parallel_size",
    "zero_stage",
    "sequence_parallel",
    "recompute_granularity",
    "micro_batch_size",
    "no_flash_attention",
    "optimizer",
    "release_fp32_grad",
)
"""Flags `--auto` does not take: the ranking chooses the layout (TP, PP, virtual PP, DP, ZeRO,
recompute, micro-batch) and models flash attention, AdamW and the fp32 gradient as it ranks."""


def given_flags(argv: list[str], dests: tuple[str, ...]) -> list[str]:
    """The flags among `dests` that `argv` spells out (a default value given explicitly counts)."""
    parser = build_parser()
    unset = object()  # not a string: argparse would run a string default through `type`
    parser.set_defaults(**dict.fromkeys(dests, unset))
    seen, _ = parser.parse_known_args(argv)
    return ["--" + d.replace("_", "-") for d in dests if getattr(seen, d) is not unset]


def auto(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """`--auto`: list the fastest layouts that fit and the command of the best."""
    chosen = given_flags(sys.argv[1:] if argv is None else argv, AUTO_CHOSEN)
    if chosen:
        raise ValueError(
            f"--auto chooses the layout itself and ranks with flash attention, AdamW and no "
            f"--release-fp32-grad; drop {' '.join(chosen)} (or drop --auto to size that layout)"
        )
    if not (args.world_size and args.device_memory):
        raise ValueError("--auto needs --world-size N and --device-memory SIZE (e.g. 64GiB)")
    offloads = ("cpu_offload", "optimizer_cpu_offload", "optimizer_nvme", "param_nvme")
    for flag in (*offloads, "deepspeed_estimate"):
        if getattr(args, flag):
            raise ValueError(
                f"--auto ranks layouts without offload and prints no DeepSpeed table; drop "
                f"--{flag.replace('_', '-')} (or drop --auto to size that layout)"
            )
    config = _config(args)
    hw = Hardware(
        device_memory=parse_bytes(args.device_memory),
        devices_per_node=args.devices_per_node,
        peak_tflops=args.peak_tflops,
    )
    precision = "fp16" if args.fp16 else "bf16"
    batch = args.global_batch_size or 8 * args.world_size
    found = candidates(config, args.world_size, batch, args.seq_length, hw, precision=precision)
    if not found:
        print(
            f"no layout of {args.world_size} devices fits {args.device_memory} per device "
            "(tried TP, PP, virtual PP, ZeRO 0-3, recompute, micro-batch 1-8); add devices "
            "or memory, or shorten --seq-length"
        )
        return 1
    head = f"{'#':>3} {'TP':>3} {'PP':>3} {'VPP':>4} {'DP':>4} {'ZeRO':>5} {'recompute':>10}"
    head += f" {'mbs':>4} {'peak GiB':>9} {'step s':>8} {'tokens/s':>12}"
    print(head)
    print("-" * len(head))
    for i, c in enumerate(found[: args.top], 1):
        lo = c.layout
        print(
            f"{i:>3} {lo.tensor_parallel:>3} {lo.pipeline_parallel:>3} {lo.virtual_stages:>4} "
            f"{lo.data_parallel:>4} {lo.zero_stage:>5} {lo.recompute:>10} "
            f"{lo.micro_batch_size:>4} {c.peak_bytes / 2**30:>9.2f} {c.step_seconds:>8.3f} "
            f"{c.tokens_per_second:>12,.0f}"
        )
    name = args.model or "MODEL"
    print("best:")
    print(command_line(name, config.num_layers, found[0], args.world_size, args.devices_per_node))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshline estimate`."""
    args = build_parser().parse_args(argv)
    if args.auto:
        try:
            return auto(args, argv)
        except ValueError as exc:
            print(f"meshline estimate: {exc}", file=sys.stderr)
            return 2
    try:
        config = _config(args)
        layout = _layout(args, config)
        rows = estimate(config, layout)
        deepspeed = None
        if args.deepspeed_estimate:
            # the network stack loads only for --deepspeed-estimate: the estimate itself needs none
            from models.transformer import build_model

            counts = model_counts(build_model(config, device="meta"))
            deepspeed = format_deepspeed(args, counts, layout)
        elif args.additional_buffer_factor is not None:
            raise ValueError("--additional-buffer-factor is DeepSpeed's: add --deepspeed-estimate")
    except ValueError as exc:
        print(f"meshline estimate: {exc}", file=sys.stderr)
        return 2
    world = layout.tensor_parallel * layout.pipeline_parallel * layout.data_parallel
    print(
        f"model {config.extra.get('registry_name', config.family)}: "
        f"{format_count(count_parameters(config))} parameters, {config.num_layers} layers, "
        f"hidden {config.hidden_size}"
    )
    print(
        f"layout TP={layout.tensor_parallel} PP={layout.pipeline_parallel} "
        f"(virtual {layout.virtual_stages}) DP={layout.data_parallel} world={world} "
        f"ZeRO-{layout.zero_stage} {layout.precision} recompute={layout.recompute} "
        f"SP={layout.sequence_parallel} offload={layout.cpu_offload} "
        f"optimizer-offload={layout.optimizer_offload or 'none'} "
        f"param-nvme={layout.param_nvme} "
        f"micro-batch={layout.micro_batch_size} seq={layout.seq_length}"
    )
    print("per-device memory at the training peak (GiB):")
    print(format_table(rows))
    if deepspeed is not None:
        print(deepspeed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
