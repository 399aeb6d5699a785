"""ModelLink's and Megatron-LM's converter flags for `meshline convert`, as `CompatFlag` rows
(services/common/compat_flags.py, the one table type every command's compatibility flags use).

- ModelLink `tools/ckpt_convert/llama/convert_weights_from_huggingface.py --input-model-dir HF
  --output-model-dir OUT --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --type
  7B [--deepspeed]`: HF in, Megatron out (`--deepspeed`: a native checkpoint, which Meshline's
  ZeRO training loads); no `--load-format`/`--save-format` needed.
- ModelLink's LoRA merge (`--load BASE --lora-load LORA --save OUT --lora-r R --lora-alpha A
  --lora-target-modules ...`): Megatron in and out, the adapter merged.
- Megatron-LM `tools/checkpoint/convert.py --model-type GPT --loader llama_mistral --saver
  mcore --load-dir --save-dir --target-tensor-parallel-size N --model-size llama2-7B`.

The spellings that are settings of the conversion itself (`--input-model-dir`, `--lora-load`,
`--tokenizer-model`, ...) are flags of `ConvertOptions`' fields (cli.py); the rows here are the
rest. `resolve(args)` applies them: a `map` row sets a Meshline option (a contradiction with an
explicit one is an error naming both), a `check` row refuses what Meshline does not convert, the
`same` row (`--megatron-path`) needs nothing (docs/decisions.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from services.common import compat_flags
from services.common.compat_flags import CompatFlag

# --loader / --saver plugin names of Megatron's convert.py -> Meshline formats.
LOADERS = {
    "megatron": "megatron",
    "mcore": "megatron",
    "legacy": "megatron",
    "llama_mistral": "hf",
    "llama2_hf": "hf",
    "hf": "hf",
    "mixtral_hf": "hf",
}
SAVERS = {"megatron": "megatron", "mcore": "megatron", "legacy": "megatron", "hf": "hf",
          "llama2_hf": "hf"}  # fmt: skip
# ModelLink's --type (LLaMA-1: 7B 13B 30B 65B; Llama-2: 7B 13B 34B 70B) -> registry config.
TYPES = {
    "7B": "llama2-7B",
    "13B": "llama2-13B",
    "30B": "llama-33B",
    "33B": "llama-33B",
    "65B": "llama-65B",
    "34B": "llama2-34B",
    "70B": "llama2-70B",
}
Convert = Callable[[Any, dict[str, Any]], dict[str, Any]]


def _plugin(flag: str, dest: str, names: dict[str, str]) -> Convert:
    """A Megatron convert.py plugin name -> the Meshline format it reads or writes."""

    def convert(value: Any, given: dict[str, Any]) -> dict[str, Any]:
        if value not in names:
            raise ValueError(f"{flag} {value}: choose one of {', '.join(sorted(names))}")
        return {dest: names[value]}

    return convert


def _model_size(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    # convert.py's llama_mistral loader names chat models with a trailing "f" (llama2-7Bf).
    return {"model": value[:-1] if value.endswith("f") else value}


def _type(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if value not in TYPES:
        raise ValueError(
            f"--type {value}: known sizes {', '.join(TYPES)}; other models: --model NAME"
        )
    return {"model": TYPES[value]}


def _model_type(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if value.upper() != "GPT":
        raise ValueError(f"--model-type {value}: only GPT (decoder-only) checkpoints are converted")
    return {}


def _checkpoint_type(value: Any, given: dict[str, Any]) -> dict[str, Any]:
    if value == "meta":
        raise ValueError(
            "--checkpoint-type meta: convert Meta's .pth release to HF first "
            "(transformers' convert_llama_weights_to_hf.py), then pass --checkpoint-type hf"
        )
    if value != "hf":
        raise ValueError(f"--checkpoint-type {value}: choose hf (or meta, which is refused)")
    return {}


TABLE: tuple[CompatFlag, ...] = (
    # --- statements about the source: what Meshline does not convert is refused
    CompatFlag("--model-type", "check", "Megatron convert.py: GPT (decoder-only) is the one "
               "supported", nargs=1, convert=_model_type),
    CompatFlag("--checkpoint-type", "check", "Megatron convert.py: hf (meta's original .pth "
               "layout is not read)", nargs=1, convert=_checkpoint_type),
    # --- the formats and the model they imply
    CompatFlag("--loader", "map", "Megatron convert.py loader plugin; sets --load-format "
               f"(llama_mistral -> hf): one of {', '.join(sorted(LOADERS))}", nargs=1,
               convert=_plugin("--loader", "load_format", LOADERS)),
    CompatFlag("--saver", "map", "Megatron convert.py saver plugin; sets --save-format "
               f"(mcore -> megatron): one of {', '.join(sorted(SAVERS))}", nargs=1,
               convert=_plugin("--saver", "save_format", SAVERS)),
    CompatFlag("--deepspeed", "map", "ModelLink: write for ZeRO (DeepSpeed) training, i.e. "
               "--save-format native", sets=(("save_format", "native"),)),
    CompatFlag("--model-size", "map", "Megatron convert.py (llama_mistral loader): e.g. "
               "llama2-7B; same as --model", nargs=1, convert=_model_size),
    CompatFlag("--type", "map", "ModelLink: --type 7B/13B means --model llama2-7B/13B, 30B/65B "
               "the LLaMA-1 llama-33B/65B (other families: use --model)", nargs=1,
               convert=_type),
    CompatFlag("--fp16", "map", "same as --dtype fp16", sets=(("dtype", "fp16"),)),
    CompatFlag("--bf16", "map", "same as --dtype bf16", sets=(("dtype", "bf16"),)),
    CompatFlag("--megatron-path", "same", "Megatron convert.py: where its code lives; Meshline "
               "reads Megatron checkpoints with its own readers and imports no Megatron "
               "checkout, so this is already satisfied", nargs=1),
)  # fmt: skip


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The ModelLink / Megatron converter flags that are not `ConvertOptions`' own."""
    compat_flags.add_rows(
        parser,
        TABLE,
        "ModelLink / Megatron conversion-script flags",
        "accepted for unchanged scripts: each sets a Meshline option, refuses what is not "
        "converted, or is already Meshline's behaviour (see each)",
    )


def resolve(args: argparse.Namespace) -> list[str]:
    """Fill load_format / save_format / model / dtype / merge_lora from the ModelLink-style flags.

    Raises ValueError naming the flag; returns notes for the user (none today).
    """
    for row, value in compat_flags.given(args, TABLE):
        if row.kind == "same":
            continue
        mapped = dict(row.sets) if row.convert is None else row.convert(value, vars(args))
        said = row.flag if row.nargs == 0 else f"{row.flag} {value}"
        for dest, setting in mapped.items():
            _set(args, dest, setting, said)
    if args.lora_dir and not args.merge_lora:
        args.merge_lora = True  # ModelLink's merge script: --lora-load means merge
    if args.load_format is None:
        # ModelLink scripts name no format: HF -> Megatron, or Megatron -> Megatron (LoRA merge).
        args.load_format = "megatron" if args.lora_dir else "hf"
    if args.save_format is None:
        args.save_format = "megatron"
    if args.lora_target_modules and not args.lora_dir:
        raise ValueError(
            "--lora-target-modules describes the adapter to merge; give it with --lora-load DIR"
        )
    return []


def _set(args: argparse.Namespace, dest: str, value: str, flag: str) -> None:
    current = getattr(args, dest)
    if current is not None and current != value:
        raise ValueError(
            f"{flag} means --{dest.replace('_', '-')} {value}, but "
            f"--{dest.replace('_', '-')} {current} is given; drop one"
        )
    setattr(args, dest, value)
