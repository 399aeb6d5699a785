"""`meshline estimate --auto --trial N`: measure the analytic ranking's top N layouts, pick the
fastest that fits.

    meshline estimate --auto --trial 3 --model tiny-llama --world-size 2 --device-memory 4GiB \
        --global-batch-size 8 --seq-length 32 --mock-data

`models.auto_config` ranks every layout of --world-size devices that fits --device-memory by its
cost model (the first cut, as `meshline estimate --auto`); the top N are then run as short
training jobs through `meshline train --autotune`'s own trial machinery
(`training.autotune.run_points`, each trial a launch of this job's workers by
`autotune_launch.trial_runner`): --trial-warmup-steps unmeasured steps, then --trial-steps
measured ones. A trial that fails, runs past --trial-timeout or whose measured peak exceeds
--device-memory (on a CPU run: each rank's peak resident set) does not fit; the pick is the fit
trial of the highest measured job throughput. Every flag that `meshline estimate` does not own is
a training flag of the trials (data: --mock-data or --data-path and --tokenizer-model, the
optimizer, ...), checked before any worker starts.

What cannot be measured on this machine is refused by name before any trial: more ranks than it
launches (one a CPU core, or one an accelerator), a multi-node --world-size, or a model whose
ranked layouts need more memory than the machine has.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from checkpoints.safe_fs import open_dir_beneath
from engine.linear_choice import available_memory
from kernels.cpu.threads import available_cpus
from kernels.device import resolve
from models.auto_config import Candidate, Hardware, candidates, command_line
from models.estimate import AUTO_CHOSEN
from models.estimate import build_parser as estimate_parser
from models.memory import parse_bytes
from services.trainer.arguments import parse_args
from services.trainer.autotune_launch import trial_runner
from services.trainer.train_config import TrainConfig
from training import autotune
from training.autotune_section import MAX_TRIAL_STEPS, AutotuneSection
from training.launch_checks import check_inputs, check_paths

FORWARDED = {
    "model": "--model",
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "vocab_size": "--vocab-size",
}
"""Estimate flags that define the model: passed on to the trials as the same training flags."""
RANKED = (
    *AUTO_CHOSEN,
    "cpu_offload",
    "optimizer_cpu_offload",
    "optimizer_nvme",
    "deepspeed_estimate",
    "additional_buffer_factor",
)
"""Estimate flags of one layout or its memory model: the ranking chooses the layout, so with
--trial they are refused rather than ignored."""


@dataclass(frozen=True)
class MeasuredLayout:
    """One ranked layout and its measured trial."""

    rank: int
    """Its place in the analytic ranking (1: the cost model's fastest)."""
    candidate: Candidate
    """The layout with its estimated peak and step time."""
    outcome: autotune.TrialResult
    """What its trial measured, or why it was rejected."""
    job_tokens_per_s: float | None
    """Measured tokens/s of the whole job (rank 0's times the data-parallel size)."""


def build_parser() -> argparse.ArgumentParser:
    """`meshline estimate`'s flags plus the trial group."""
    parser = estimate_parser()
    parser.prog = "meshline estimate --auto --trial N"
    parser.description = __doc__.split("\n")[0]
    group = parser.add_argument_group("measured trials (--trial; other flags go to the trials)")
    group.add_argument("--trial", type=int, required=True, help="layouts of the ranking to run")
    group.add_argument(
        "--nproc-per-node", type=int, help="processes of each trial (default --world-size)"
    )
    group.add_argument("--trial-warmup-steps", type=int, default=3, help="steps before measuring")
    group.add_argument("--trial-steps", type=int, default=2, help="steps measured per trial")
    group.add_argument(
        "--trial-timeout", type=float, default=600.0, help="seconds a trial may take"
    )
    group.add_argument(
        "--trial-dir", help="each trial's config, log and metrics (default: a temporary folder)"
    )
    return parser


def check_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Flags --trial cannot apply, refused by name (ValueError)."""
    if not args.auto:
        raise ValueError("--trial measures the layouts --auto ranks: add --auto")
    if not 1 <= args.trial <= 64:
        raise ValueError(f"--trial {args.trial}: give 1 to 64 layouts to measure")
    if not (args.world_size and args.device_memory):
        raise ValueError("--auto needs --world-size N and --device-memory SIZE (e.g. 64GiB)")
    given = [name for name in RANKED if getattr(args, name) != parser.get_default(name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(
            f"{flags}: --auto --trial measures the layouts the ranking chooses; drop it, or drop "
            "--auto --trial to size that one layout"
        )
    listed = [
        name
        for name in ("top", "devices_per_node")
        if getattr(args, name) != parser.get_default(name)
    ]
    if listed:
        flags = ", ".join("--" + name.replace("_", "-") for name in listed)
        raise ValueError(
            f"{flags}: with --trial the table lists the N measured layouts and the trials run on "
            "this machine as one node; drop it (or drop --trial for the analytic table)"
        )
    if args.trial_warmup_steps < 0 or args.trial_steps < 1:
        raise ValueError(
            f"--trial-warmup-steps {args.trial_warmup_steps} / --trial-steps {args.trial_steps}: "
            "give >= 0 warm-up steps and >= 1 measured step"
        )
    if args.trial_warmup_steps + args.trial_steps > MAX_TRIAL_STEPS:
        raise ValueError(
            f"--trial-warmup-steps + --trial-steps is "
            f"{args.trial_warmup_steps + args.trial_steps}; a trial runs at most "
            f"{MAX_TRIAL_STEPS} steps"
        )
    if not 0 < args.trial_timeout <= 86400:
        raise ValueError(f"--trial-timeout {args.trial_timeout:g}: give (0, 86400] seconds")


@dataclass(frozen=True)
class LocalMachine:
    """What this machine can launch a trial on."""

    device: str
    """cpu, cuda or npu (the trainer's platform, $MESHLINE_DEVICE honoured)."""
    max_ranks: int
    """Processes one trial may have: one a CPU core, or one an accelerator."""
    memory: int | None
    """Bytes the ranks may use: available host memory shared by all ranks on a CPU, one
    device's memory on an accelerator (None: unknown)."""


def local_machine() -> LocalMachine:
    """The trainer's platform here and what it can hold."""
    platform = resolve()
    if platform.type == "cpu":
        return LocalMachine("cpu", available_cpus(), available_memory())
    try:
        memory: int | None = int(platform.module.mem_get_info()[1])
    except (AttributeError, RuntimeError):
        memory = None
    return LocalMachine(platform.type, platform.device_count(), memory)


def check_machine(
    args: argparse.Namespace, ranked: list[Candidate], machine: LocalMachine, model: str
) -> int:
    """The processes per trial; ValueError naming what this machine cannot measure."""
    world = args.world_size
    nproc = args.nproc_per_node or world
    if nproc != world:
        raise ValueError(
            f"--nproc-per-node {nproc} with --world-size {world}: the trials run on this machine "
            "alone (one node); give the same number, or drop --trial to rank a multi-node job"
        )
    unit = "CPU core" if machine.device == "cpu" else f"{machine.device} device"
    if world > machine.max_ranks:
        raise ValueError(
            f"--world-size {world}: this machine launches at most {machine.max_ranks} trial "
            f"ranks (one a {unit}); give --world-size {machine.max_ranks} or less, or drop "
            "--trial to rank the layouts analytically"
        )
    if machine.memory is None:
        return nproc
    shared = world if machine.device == "cpu" else 1  # CPU ranks share the host's memory
    for candidate in ranked:
        need = candidate.peak_bytes * shared
        if need > machine.memory:
            where = "host memory available" if shared > 1 else f"one {unit}'s memory"
            raise ValueError(
                f"--model {model}: its ranked layouts need {need / 2**30:.2f} GiB "
                f"({candidate.peak_bytes / 2**30:.2f} GiB a rank) and this machine has "
                f"{machine.memory / 2**30:.2f} GiB of {where}; measure a smaller --model here, "
                "or drop --trial to rank the layouts analytically"
            )
    return nproc


def base_config(args: argparse.Namespace, train_flags: list[str]) -> TrainConfig:
    """The training config every trial starts from: the model flags, the run shape and the
    training flags; ValueError for what the ranking owns."""
    for flag in train_flags:
        name = flag.split("=", 1)[0]
        if name.startswith("--autotune"):
            raise ValueError(
                f"{name} is meshline train --autotune's grid; --trial measures the ranking's top "
                "layouts (its steps: --trial-warmup-steps, --trial-steps, --trial-timeout)"
            )
        if name in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--master-addr"):
            raise ValueError(f"{name}: --trial runs its trials on this machine alone; drop it")
    argv = []
    for name, flag in FORWARDED.items():
        value = getattr(args, name)
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--seq-length", str(args.seq_length)]
    argv += ["--global-batch-size", str(args.global_batch_size or 8 * args.world_size)]
    argv += ["--bf16"] if args.bf16 else ["--fp16"] if args.fp16 else []
    config = parse_args([*argv, *train_flags], read_files=True)
    defaults = TrainConfig()
    owned = [
        ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
        ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
        ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
        ("--context-parallel-size", "context_parallel_size"),
        ("--sequence-parallel", "sequence_parallel"),
        ("--zero-stage", "zero_stage"),
        ("--recompute-granularity", "recompute_granularity"),
        ("--micro-batch-size", "micro_batch_size"),
    ]
    for flag, name in owned:
        section = "batch" if name == "micro_batch_size" else "parallel"
        value = getattr(getattr(config, section), name, None)
        if value != getattr(getattr(defaults, section), name, None):
            raise ValueError(
                f"{flag} {value} (from --config): the ranking chooses it for each trial; drop it"
            )
    check_paths(config)
    check_inputs(config)
    return config


def layout_config(
    config: TrainConfig, candidate: Candidate, section: AutotuneSection
) -> TrainConfig:
    """`config` with the candidate's TP/PP/virtual PP/SP and the trial settings; the trial's
    ZeRO stage, recompute and micro-batch come from `autotune.apply`."""
    layout = candidate.layout
    per_chunk = None
    if layout.virtual_stages > 1:
        per_chunk = config.model_config().num_layers // (
            layout.pipeline_parallel * layout.virtual_stages
        )
    parallel = replace(
        config.parallel,
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        num_layers_per_virtual_pipeline_stage=per_chunk,
        sequence_parallel=layout.sequence_parallel,
    )
    return replace(config, parallel=parallel, autotune=section)


def trial_of(candidate: Candidate) -> autotune.Trial:
    """The candidate's ZeRO stage, recompute and micro-batch as an autotune point."""
    layout = candidate.layout
    return autotune.Trial(layout.micro_batch_size, layout.zero_stage, layout.recompute)


def format_measured(rows: list[MeasuredLayout], best: MeasuredLayout | None) -> str:
    """Every trial with its layout, the estimate and the measure; the pick marked."""
    head = (
        f"{'#':>3} {'TP':>3} {'PP':>3} {'VPP':>4} {'DP':>4} {'ZeRO':>5} {'recompute':>10} "
        f"{'mbs':>4} {'est GiB':>8} {'est tok/s':>12} {'tok/s (job)':>12} {'peak MiB':>9} "
        f"{'seconds':>8}  status"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        lo, t = row.candidate.layout, row.outcome
        measured = f"{row.job_tokens_per_s:,.1f}" if row.job_tokens_per_s is not None else "-"
        peak = f"{t.peak_bytes / 2**20:.1f}" if t.peak_bytes is not None else "-"
        status = t.status if t.status == "ok" else f"{t.status}: {t.note}"
        mark = "  <- pick" if row is best else ""
        lines.append(
            f"{row.rank:>3} {lo.tensor_parallel:>3} {lo.pipeline_parallel:>3} "
            f"{lo.virtual_stages:>4} {lo.data_parallel:>4} {lo.zero_stage:>5} {lo.recompute:>10} "
            f"{lo.micro_batch_size:>4} {row.candidate.peak_bytes / 2**30:>8.2f} "
            f"{row.candidate.tokens_per_second:>12,.0f} {measured:>12} {peak:>9} "
            f"{t.seconds:>8.1f}  {status}{mark}"
        )
    return "\n".join(lines)


def write_report(rows: list[MeasuredLayout], best: MeasuredLayout | None, path: Path) -> None:
    """trials.json: each ranked layout, its estimate and its measure, and the pick's rank."""

    def row(r: MeasuredLayout) -> dict:
        outcome = {k: v for k, v in asdict(r.outcome).items() if k != "trial"}
        return {
            "rank": r.rank,
            "layout": asdict(r.candidate.layout),
            "estimated_peak_bytes": r.candidate.peak_bytes,
            "estimated_tokens_per_s": r.candidate.tokens_per_second,
            "job_tokens_per_s": r.job_tokens_per_s,
            **outcome,
        }

    data = {
        "metric": "tokens/s of the job: rank 0's over the measured steps x data-parallel size",
        "trials": [row(r) for r in rows],
        "pick": None if best is None else best.rank,
    }
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def run(argv: list[str]) -> int:
    """Rank, measure the top --trial layouts, print the table and the pick's command."""
    parser = build_parser()
    args, train_flags = parser.parse_known_args(argv)
    check_flags(args, parser)
    config = base_config(args, train_flags)
    model = config.model_config()
    name = args.model or "MODEL"
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    world = args.world_size
    hw = Hardware(
        device_memory=parse_bytes(args.device_memory),
        devices_per_node=world,  # the trials run on one node: TP may span all of it
        peak_tflops=args.peak_tflops,
    )
    batch = config.batch.global_batch_size or 8 * world
    found = candidates(model, world, batch, args.seq_length, hw, precision=precision)
    if not found:
        print(
            f"no layout of {world} devices fits {args.device_memory} per device; nothing to "
            "measure (add memory, or shorten --seq-length)"
        )
        return 1
    ranked = found[: args.trial]
    nproc = check_machine(args, ranked, local_machine(), name)
    section = AutotuneSection(
        autotune=True,
        autotune_warmup_steps=args.trial_warmup_steps,
        autotune_steps=args.trial_steps,
        autotune_memory_limit=str(hw.device_memory),
        autotune_trial_timeout=args.trial_timeout,
        autotune_dir=args.trial_dir,
    )
    points = [(layout_config(config, c, section), trial_of(c)) for c in ranked]
    print(
        f"measuring the top {len(ranked)} of {len(found)} ranked layouts: {nproc} ranks, "
        f"{args.trial_warmup_steps} warm-up + {args.trial_steps} measured steps a trial, "
        f"memory limit {hw.device_memory / 2**20:.1f} MiB a rank",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="meshline-estimate-trial-") as scratch:
        directory = Path(args.trial_dir or scratch)
        with open_dir_beneath(directory, roots=(), create=True):
            pass  # created beneath its resolved parent, never through a symlink
        result = autotune.run_points(points, nproc, trial_runner(nproc), directory)
        rows = [
            MeasuredLayout(
                rank,
                candidate,
                outcome,
                None if outcome.tokens_per_s is None else autotune.job_tokens_per_s(outcome, world),
            )
            for rank, (candidate, outcome) in enumerate(
                zip(ranked, result.trials, strict=True), start=1
            )
        ]
        best = next((r for r in rows if r.outcome is result.best), None)
        print(format_measured(rows, best), flush=True)
        write_report(rows, best, directory / "trials.json")
    if best is None:
        print(
            "meshline estimate: --trial: no measured layout fits (table above); raise "
            "--device-memory or --trial-timeout, or measure more layouts with a larger --trial",
            file=sys.stderr,
        )
        return 2
    command = command_line(name, model.num_layers, best.candidate, world, world)
    model_flags = [
        f"{flag} {shlex.quote(str(getattr(args, key)))}"
        for key, flag in FORWARDED.items()
        if getattr(args, key) is not None
    ]
    command = command.replace(f"--model {name}", " ".join(model_flags), 1)
    print(f"pick: #{best.rank} of the ranking, {best.job_tokens_per_s:,.1f} tokens/s measured")
    print(" ".join([command, *map(shlex.quote, train_flags)]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point (`meshline estimate ... --trial N`, routed here by `services.cli`)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshline estimate: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
