"""`meshline evaluate`: score a model on benchmark tasks, lm-evaluation-harness style.

    meshline evaluate --tasks mmlu,gsm8k_cot --task-data-path data/eval \\
        --endpoint localhost:50054 --output-path runs/eval [--num-fewshot N] [--limit N]
    meshline evaluate --tasks boolq --task-data-path data/eval --load ckpt --load-format hf
    meshline evaluate --tasks rm_win_rate --task-data-path prompts.jsonl --load policy \
        --reference-load sft --reward-load rm [--max-new-tokens 64]

ModelLink's evaluation command runs with the entry point renamed: `--task` is `--tasks`, its task
names (`human_eval`, `ceval`) are aliases, `--evaluation-batch-size` is `--batch-size`,
`--tokenizer-name-or-path` is `--tokenizer`, and its model / parallel flags are accepted without
effect (the checkpoint defines the model; see docs/coming-from-modellink.md).

Writes results.json and samples_{task}.jsonl under --output-path and prints a table. A rerun
with the same --output-path reuses every answer already computed (per-request cache).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from models.config import ModelConfig
from services.common import megatron_compat
from services.common.dataclass_flags import FlagSpec, add_fields, config_values
from services.evaluator.command import DEFAULT_BATCH_SIZE, DTYPES, LOAD_FORMATS, EvaluateCommand
from services.evaluator.models.base import LanguageModel
from services.evaluator.models.kind import checkpoint_is_reward
from services.evaluator.results import format_table, write_results
from services.evaluator.runner import (
    DEFAULT_TEMPERATURE,
    EvalConfig,
    JudgeModels,
    check_judge_kinds,
    evaluate,
    results_settings,
)
from services.evaluator.sandbox.runner import (
    SandboxError,
    SandboxUnavailable,
    require_isolation,
)
from services.evaluator.tasks import groups, list_tasks, resolve
from services.evaluator.tasks.base import Task
from services.evaluator.tasks.reward_win_rate import REWARD_WIN_RATE

# ModelLink's TASK names -> Meshline task or group names.
TASK_ALIASES = {"human_eval": "humaneval", "ceval": "ceval-valid"}
RUN_FLAGS = (
    "tasks",
    "task_data_path",
    "num_fewshot",
    "limit",
    "batch_size",
    "max_new_tokens",
    "output_path",
    "seed",
    "num_samples",
    "temperature",
)
"""The `EvalConfig` fields that are flags (allow_unsafe_code_execution is one too, below)."""


PLACEHOLDERS = {
    "N": ("num_fewshot", "limit", "num_samples"),
    "PATH": ("task_data_path",),
    "DIR": ("load", "reference_load", "reward_load"),
    "HOST:PORT": ("endpoint", "reference_endpoint", "reward_endpoint"),
}
"""--help placeholder -> the flags (fields) showing it, where a flag adds nothing else."""


def _specs() -> dict[str, FlagSpec]:
    """What the flags add to the dataclasses: ModelLink's spellings, choices, and the defaults
    left unset so that a ModelLink flag mapped onto them (--micro-batch-size) or a check of
    whether they were given (--temperature) can tell."""
    specs = {
        name: FlagSpec(metavar=shown) for shown, names in PLACEHOLDERS.items() for name in names
    }
    return specs | {
        "tasks": FlagSpec(
            aliases=("--task",),
            metavar="NAMES",
            help="comma-separated task or group names (--list-tasks shows them)",
            extra={"nargs": None},
        ),
        "batch_size": FlagSpec(
            aliases=("--evaluation-batch-size",),
            metavar="N",
            help=f"requests per batch (default {DEFAULT_BATCH_SIZE})",
            extra={"default": None},
        ),
        "temperature": FlagSpec(
            help=f"sampling temperature of humaneval with --num-samples > 1 (default "
            f"{DEFAULT_TEMPERATURE})",
            extra={"default": None},
        ),
        "allow_unsafe_code_execution": FlagSpec(
            help="run HumanEval's generated code even where this host cannot sandbox it in "
            "namespaces (then only rlimits and a separate uid contain it); see docs/security.md"
        ),
        "load_format": FlagSpec(choices=LOAD_FORMATS),
        "tokenizer": FlagSpec(
            aliases=("--tokenizer-name-or-path", "--tokenizer-model"), metavar="PATH"
        ),
        "max_new_tokens": FlagSpec(aliases=("--max-new-token",), metavar="N"),
        "output_path": FlagSpec(metavar="DIR", extra={"default": Path("runs/eval")}),
        "dtype": FlagSpec(choices=("auto", *DTYPES)),
    }


def build_parser() -> argparse.ArgumentParser:
    """The CLI's flags: `EvaluateCommand`'s and `EvalConfig`'s fields (type, default and help
    from the dataclasses), then the ModelLink script rows of services/common/megatron_compat."""
    parser = argparse.ArgumentParser(
        prog="meshline evaluate", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    specs = _specs()
    add_fields(parser, EvaluateCommand, ("list_tasks",), specs)
    add_fields(parser, EvalConfig, ("tasks", "task_data_path"), specs)
    add_fields(parser.add_mutually_exclusive_group(), EvaluateCommand, ("endpoint", "load"), specs)
    add_fields(parser, EvaluateCommand, ("load_format",), specs)
    for role in ("reference", "reward"):
        names = (f"{role}_load", f"{role}_endpoint")
        add_fields(parser.add_mutually_exclusive_group(), EvaluateCommand, names, specs)
    add_fields(parser, EvaluateCommand, ("tokenizer", "add_bos_token", "dtype"), specs)
    add_fields(parser, EvalConfig, RUN_FLAGS[2:], specs)
    add_fields(parser, EvaluateCommand, ("no_progress",), specs)
    add_fields(parser, EvalConfig, ("allow_unsafe_code_execution",), specs)
    megatron_compat.add_flags(parser)
    return parser


def task_names(text: str) -> tuple[str, ...]:
    """--tasks value (comma- or space-separated) with ModelLink's names mapped."""
    names = [t.strip() for t in text.replace(" ", ",").split(",") if t.strip()]
    return tuple(TASK_ALIASES.get(n, n) for n in names)


def open_model(
    args: argparse.Namespace, compat: megatron_compat.Resolved | None = None
) -> LanguageModel:
    """The model named by --endpoint or --load, once the ModelLink flags agree with it."""
    compat = megatron_compat.resolve(args) if compat is None else compat
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH_SIZE
    add_bos = None if args.add_bos_token is None else args.add_bos_token == "true"
    if args.endpoint:
        # imported here: the gRPC stubs load only for an --endpoint model
        from services.evaluator.models.grpc_client import GrpcLanguageModel

        if args.dtype not in (None, "auto"):
            raise ValueError(
                f"--dtype {args.dtype} (or --fp16/--bf16) applies to a --load model; the "
                "server's own --dtype decides for --endpoint"
            )
        unchecked = [row.flag for row, _ in compat.checks if row.flag != "--seq-length"]
        if unchecked:
            raise ValueError(
                f"{' '.join(unchecked)}: the served model's architecture is not reported over "
                "gRPC, so these cannot be checked; drop them or evaluate with --load"
            )
        model = GrpcLanguageModel(args.endpoint, batch_size=args.batch_size, add_bos_token=add_bos)
        seq = [(row, value) for row, value in compat.checks if row.flag == "--seq-length"]
        if seq:
            served = ModelConfig(max_position_embeddings=model.context_length)
            megatron_compat.check_model(megatron_compat.Resolved(checks=seq), served)
        return model
    # imported here: these load torch, which an --endpoint evaluation never needs
    from engine.loading import read_config
    from services.evaluator.models.local import LocalLanguageModel

    megatron_compat.check_model(compat, read_config(args.load, args.load_format))
    return LocalLanguageModel(
        args.load,
        load_format=args.load_format,
        tokenizer=args.tokenizer,
        batch_size=args.batch_size,
        add_bos_token=add_bos,
        dtype=args.dtype or "auto",
    )


def _open_role(args: argparse.Namespace, role: str, add_bos: bool | None) -> LanguageModel:
    """The --{role}-load or --{role}-endpoint model, its errors naming that flag."""
    endpoint = getattr(args, f"{role}_endpoint")
    if endpoint:
        # imported here: the gRPC stubs load only for an --endpoint model
        from services.evaluator.models.grpc_client import GrpcLanguageModel

        return GrpcLanguageModel(
            endpoint,
            batch_size=args.batch_size,
            add_bos_token=add_bos,
            flag=f"--{role}-endpoint",
        )
    # imported here: it loads torch, which an --endpoint evaluation never needs
    from services.evaluator.models.local import LocalLanguageModel

    return LocalLanguageModel(
        getattr(args, f"{role}_load"),
        batch_size=args.batch_size,
        add_bos_token=add_bos,
        flag=f"--{role}-load",
    )


def open_judges(args: argparse.Namespace) -> JudgeModels | None:
    """The reference (answers with the evaluated model's --add-bos-token) and reward model of
    rm_win_rate, or None where neither is given."""
    if not (args.reference_load or args.reference_endpoint):
        return None
    add_bos = None if args.add_bos_token is None else args.add_bos_token == "true"
    reference = _open_role(args, "reference", add_bos)
    try:
        return JudgeModels(reference, _open_role(args, "reward", None))
    except BaseException:
        reference.close()
        raise


def check_judge_flags(args: argparse.Namespace, selected: list[Task]) -> None:
    """rm_win_rate needs a reference and a reward model, other tasks take neither; checkpoint
    kinds that cannot serve their role are refused from their config files, before any model
    is opened."""
    wanted = any(task.output_type == REWARD_WIN_RATE for task in selected)
    given = {
        flag: value
        for flag, value in (
            ("--reference-load", args.reference_load),
            ("--reference-endpoint", args.reference_endpoint),
            ("--reward-load", args.reward_load),
            ("--reward-endpoint", args.reward_endpoint),
        )
        if value
    }
    if not wanted:
        if given:
            raise ValueError(
                f"{', '.join(given)}: only task rm_win_rate uses a reference and a reward "
                "model, and it is not among --tasks; leave them out or add rm_win_rate"
            )
        return
    missing = [
        flags
        for flags in ("--reference-load/--reference-endpoint", "--reward-load/--reward-endpoint")
        if not any(f in given for f in flags.split("/"))
    ]
    if missing:
        raise ValueError(
            f"task rm_win_rate compares the evaluated model with a reference under a reward "
            f"model: give {' and '.join(missing)}"
        )
    if args.num_fewshot:
        raise ValueError(
            f"--num-fewshot {args.num_fewshot}: task rm_win_rate compares answers to bare "
            "prompts, which take no few-shot examples; give 0 or leave it out"
        )
    if args.load and checkpoint_is_reward(args.load, args.load_format):
        raise ValueError(
            f"--load {args.load} is a reward model (a scalar value head): rm_win_rate's "
            "evaluated model (the policy) answers prompts, so it must be a causal LM"
        )
    check_judge_kinds(
        "--reference-load",
        str(args.reference_load),
        checkpoint_is_reward(args.reference_load) if args.reference_load else None,
        "--reward-load",
        str(args.reward_load),
        checkpoint_is_reward(args.reward_load) if args.reward_load else None,
    )


def eval_config(args: argparse.Namespace) -> EvalConfig:
    """The run's `EvalConfig` from parsed flags (ModelLink's already resolved onto them)."""
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH_SIZE
    values = config_values(args, EvalConfig)
    values["tasks"] = task_names(args.tasks)
    if args.temperature is None:
        values["temperature"] = DEFAULT_TEMPERATURE
    return EvalConfig(**values)


def check_sampling(args: argparse.Namespace, config: EvalConfig, selected: list[Task]) -> None:
    """--num-samples and --temperature apply to humaneval's sampled completions only; humaneval
    needs a sandbox (or the operator's --allow-unsafe-code-execution)."""
    if config.num_samples > 1 and all(task.name != "humaneval" for task in selected):
        raise ValueError(
            f"--num-samples {config.num_samples} applies to humaneval only, which is not "
            "among --tasks; add humaneval or drop --num-samples"
        )
    if args.temperature is not None and config.num_samples == 1:
        raise ValueError(
            "--temperature applies to humaneval's sampled completions (--num-samples > 1); "
            "with one sample the completion is greedy: drop --temperature or raise "
            "--num-samples"
        )
    if any(task.name == "humaneval" for task in selected):
        require_isolation(config.allow_unsafe_code_execution)


def _open_checked(
    args: argparse.Namespace,
) -> tuple[EvalConfig, LanguageModel, JudgeModels | None]:
    """Every flag checked (unknown tasks before a model is opened), then the models opened."""
    compat = megatron_compat.resolve(args)
    config = eval_config(args)
    selected = resolve(list(config.tasks))
    check_sampling(args, config, selected)
    check_judge_flags(args, selected)
    model = open_model(args, compat)
    try:
        return config, model, open_judges(args)
    except BaseException:
        model.close()
        raise


def _print_task_list() -> None:
    for name, members in sorted(groups().items()):
        print(f"{name} (group of {len(members)})")
    print("\n".join(list_tasks()))


def main(argv: list[str] | None = None) -> int:
    """Run an evaluation; 0 on success, 2 on bad flags or data, 1 when the sandbox failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_tasks:
        _print_task_list()
        return 0
    if not args.tasks or args.task_data_path is None:
        parser.error("--tasks and --task-data-path are required")
    if not args.endpoint and not args.load:
        parser.error("give --endpoint host:port or --load DIR")
    start = time.time()
    try:
        config, model, judges = _open_checked(args)
    except (ValueError, ConnectionError, SandboxUnavailable) as exc:
        print(f"meshline evaluate: error: {exc}", file=sys.stderr)
        return 2
    try:
        outcomes = evaluate(
            config, model, judges=judges, show_bar=False if args.no_progress else None
        )
    except (ValueError, SandboxUnavailable) as exc:
        print(f"meshline evaluate: error: {exc}", file=sys.stderr)
        return 2
    except SandboxError as exc:
        print(f"meshline evaluate: error: the HumanEval sandbox failed: {exc}", file=sys.stderr)
        return 1
    finally:
        model.close()
        if judges is not None:
            judges.close()
    kind = "meshline-grpc" if args.endpoint else "meshline-local"
    settings = results_settings(kind, args.endpoint or str(args.load), config, judges)
    path, document = write_results(args.output_path, outcomes, settings, start)
    print(format_table(document))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
