"""`meshline convert`: convert and reshard checkpoints between HF, native and Megatron layouts.

Flags keep ModelLink's names as aliases (`--input-model-dir`, `--output-model-dir`,
`--tensor-model-parallel-size`, `--pipeline-model-parallel-size`, `--type 7B`,
`--params-dtype`, `--deepspeed`, `--load`/`--save`, LoRA merge flags) and Megatron-LM's
`tools/checkpoint/convert.py` flags (`--loader`, `--saver`, `--model-type GPT`, `--model-size`),
so their conversion scripts run with the entry point renamed (`modellink_flags`). The flags are
derived from `ConvertOptions` (services/common/dataclass_flags.py). Exit codes: 0 done, 1 the
conversion failed (a message names the input and the fix), 2 bad flags, 3 the parity check
failed (nothing was written).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from checkpoints.native_format import PPO_MODELS
from checkpoints.registry import GGUF_TYPES, QUANTIZE_CHOICES, QUANTIZE_METHODS
from checkpoints.units import DTYPES
from services.common.dataclass_flags import (
    FlagSpec,
    add_fields,
    add_renamed_fields,
    config_values,
)
from services.converter import modellink_flags
from services.converter.job import (
    FORMATS,
    LOAD_FORMATS,
    ConvertOptions,
    Progress,
    VerificationFailed,
    convert,
)

EXIT_FAILED, EXIT_USAGE, EXIT_VERIFY = 1, 2, 3
GROUPS: dict[str, tuple[str, ...]] = {
    "source and output": (
        "load_format",
        "save_format",
        "load_dir",
        "save_dir",
        "model",
        "load_iteration",
        "overwrite",
        "tokenizer_model",
        "ppo_model",
    ),
    "Megatron output layout": (
        "target_tp",
        "target_pp",
        "layers_per_virtual_stage",
        "make_vocab_size_divisible_by",
    ),
    "LoRA merge": ("lora_dir", "lora_r", "lora_alpha", "lora_target_modules"),
    "weights": (
        "dtype",
        "gguf_type",
        "quantize",
        "group_size",
        "quantize_affine",
        "keep_embedding",
    ),
    "GPTQ (--quantize-method gptq)": (
        "quantize_method",
        "calibration_data",
        "calibration_samples",
        "calibration_seq_len",
        "gptq_act_order",
        "gptq_damp",
    ),
    "parity check": ("verify", "verify_tolerance"),
}
"""Which `ConvertOptions` fields are flags, in which --help group (`max_shard_bytes` is
--max-shard-size-mb, in MB; `extra` is set by no flag)."""
MAIN_SPELLINGS = {
    "target_tp": "--target-tensor-parallel-size",
    "target_pp": "--target-pipeline-parallel-size",
    "layers_per_virtual_stage": "--num-layers-per-virtual-pipeline-stage",
    "lora_dir": "--lora-load",
}
"""Fields whose flag keeps Megatron-LM's / ModelLink's name rather than the field's."""


PLACEHOLDERS = {
    "N": (
        "load_iteration",
        "layers_per_virtual_stage",
        "make_vocab_size_divisible_by",
        "group_size",
    ),
    "NAME": ("model", "lora_target_modules"),
    "DIR": ("lora_dir",),
    "PATH": ("tokenizer_model",),
    "R": ("lora_r",),
    "A": ("lora_alpha",),
    "X": ("verify_tolerance",),
}
"""--help placeholder -> the flags (fields) showing it, where a flag adds nothing else."""


def _specs() -> dict[str, FlagSpec]:
    """What the flags add to `ConvertOptions`: old scripts' spellings, placeholders, choices."""
    specs = {
        name: FlagSpec(metavar=shown) for shown, names in PLACEHOLDERS.items() for name in names
    }
    return specs | {
        "load_format": FlagSpec(choices=LOAD_FORMATS),
        "save_format": FlagSpec(choices=FORMATS),
        "load_dir": FlagSpec(aliases=("--input-model-dir", "--load"), metavar="DIR", required=True),
        "save_dir": FlagSpec(
            aliases=("--output-model-dir", "--save"), metavar="DIR", required=True
        ),
        "ppo_model": FlagSpec(choices=PPO_MODELS),
        "target_tp": FlagSpec(aliases=("--tensor-model-parallel-size",), metavar="N"),
        "target_pp": FlagSpec(aliases=("--pipeline-model-parallel-size",), metavar="N"),
        "dtype": FlagSpec(aliases=("--params-dtype",), choices=tuple(DTYPES)),
        "gguf_type": FlagSpec(choices=GGUF_TYPES),
        "quantize": FlagSpec(choices=QUANTIZE_CHOICES),
        "quantize_method": FlagSpec(aliases=("--method",), choices=QUANTIZE_METHODS),
        "calibration_data": FlagSpec(metavar="PREFIX"),
        "calibration_samples": FlagSpec(metavar="N"),
        "calibration_seq_len": FlagSpec(metavar="TOKENS"),
        "gptq_damp": FlagSpec(metavar="FRACTION"),
    }


def _add_group(parser: argparse.ArgumentParser, title: str, names: tuple[str, ...]) -> Any:
    """One --help group of `ConvertOptions` flags, in the order of `names`."""
    group = parser.add_argument_group(title)
    specs = _specs()
    for name in names:
        if name in MAIN_SPELLINGS:
            add_renamed_fields(group, ConvertOptions, {name: MAIN_SPELLINGS[name]}, specs)
        else:
            add_fields(group, ConvertOptions, (name,), specs)
    return group


def build_parser() -> argparse.ArgumentParser:
    """The `meshline convert` flag parser: one flag per `ConvertOptions` field in GROUPS (type,
    default and help from the dataclass), the few flags that are no field, and the ModelLink /
    Megatron script rows of `modellink_flags`."""
    parser = argparse.ArgumentParser(
        prog="meshline convert",
        description=(
            "Convert a checkpoint between HF (config.json + safetensors), Meshline native (DCP "
            "step directories), Megatron legacy (iter_*/mp_rank_*/model_optim_rng.pt) and "
            "llama.cpp GGUF layouts (and from DeepSpeed ZeRO / FSDP checkpoints; to weight-only "
            "int8/int4 quantized checkpoints), resharding Megatron outputs to any "
            "TP/PP size, optionally merging a LoRA "
            "adapter and checking logit parity. Works one layer at a time; the output appears "
            "only when complete."
        ),
        allow_abbrev=False,
    )
    groups = {title: _add_group(parser, title, names) for title, names in GROUPS.items()}
    groups["source and output"].add_argument(
        "--max-shard-size-mb",
        type=int,
        metavar="MB",
        default=2048,
        help="HF outputs larger than this are split into shards with an index (default 2048)",
    )
    groups["LoRA merge"].add_argument(
        "--merge-lora",
        action="store_true",
        help="fold the --lora-load adapter into the weights: W + (alpha/r)·B·A (implied by "
        "--lora-load, as in ModelLink's merge script)",
    )
    modellink_flags.add_flags(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> ConvertOptions:
    """Validated ConvertOptions from parsed flags (ValueError names the flag)."""
    if args.merge_lora and not args.lora_dir:
        raise ValueError("--merge-lora needs --lora-load DIR (the adapter to merge)")
    notes = modellink_flags.resolve(args)
    if notes:
        print(
            f"meshline convert: note: {' '.join(notes)}",
            file=sys.stderr,
        )
    if args.max_shard_size_mb < 1:
        raise ValueError("--max-shard-size-mb must be >= 1")
    return ConvertOptions(
        **config_values(args, ConvertOptions), max_shard_bytes=args.max_shard_size_mb * 1024**2
    )


def _print_progress(progress: Progress) -> None:
    if progress.current_tensor:
        logging.getLogger("meshline.convert").info(
            "%-10s %s (%d/%d tensors, %d/%d layers)",
            progress.stage,
            progress.current_tensor,
            progress.tensors_done,
            progress.tensors_total,
            progress.layers_done,
            progress.layers_total,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshline convert`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        options = options_from_args(args)
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"meshline convert: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = convert(options, _print_progress)
    except VerificationFailed as exc:
        print(f"meshline convert: {exc}", file=sys.stderr)
        return EXIT_VERIFY
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as exc:
        print(f"meshline convert: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"wrote {report.output_dir}: {len(report.files)} files, {report.num_tensors} tensors, "
        f"{report.num_parameters:,} parameters"
    )
    if report.verify_skipped is not None:
        print(f"verify: {report.verify_skipped}")
    if report.verify is not None:
        print(
            f"verify: max |logit difference| {report.verify.max_abs_logit_diff:.3g} <= "
            f"{report.verify.tolerance:.3g} (passed)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
