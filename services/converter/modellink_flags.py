"""ModelLink's and Megatron-LM's converter flags for `meshline convert`.

- ModelLink `tools/ckpt_convert/llama/convert_weights_from_huggingface.py --input-model-dir HF
  --output-model-dir OUT --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --type
  7B [--deepspeed]`: HF in, Megatron out (`--deepspeed`: a native checkpoint, which Meshline's
  ZeRO training loads); no `--load-format`/`--save-format` needed.
- ModelLink's LoRA merge (`--load BASE --lora-load LORA --save OUT --lora-r R --lora-alpha A
  --lora-target-modules ...`): Megatron in and out, the adapter merged.
- Megatron-LM `tools/checkpoint/convert.py --model-type GPT --loader llama_mistral --saver
  mcore --load-dir --save-dir --target-tensor-parallel-size N --model-size llama2-7B`.

`resolve(args)` fills the Meshline options these imply. No flag is accepted without effect:
`--lora-target-modules` is checked against the adapter, `--tokenizer-model` against the model and
the source's tokenizer (and carried), and `--megatron-path` names Megatron's code, which Meshline
does not need (docs/decisions.md).
"""

from __future__ import annotations

import argparse

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


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The ModelLink / Megatron converter flags that are not Meshline's own names."""
    p = parser.add_argument
    p(
        "--deepspeed",
        action="store_true",
        help="ModelLink: write for ZeRO (DeepSpeed) training, i.e. --save-format native",
    )
    p(
        "--model-type",
        metavar="TYPE",
        help="Megatron convert.py: GPT (decoder-only) is the one supported",
    )
    p(
        "--loader",
        choices=sorted(LOADERS),
        help="Megatron convert.py loader plugin; sets --load-format (llama_mistral -> hf)",
    )
    p(
        "--saver",
        choices=sorted(SAVERS),
        help="Megatron convert.py saver plugin; sets --save-format (mcore -> megatron)",
    )
    p(
        "--model-size",
        metavar="NAME",
        help="Megatron convert.py (llama_mistral loader): e.g. llama2-7B; same as --model",
    )
    p(
        "--checkpoint-type",
        choices=("hf", "meta"),
        help="Megatron convert.py: hf (meta's original .pth layout is not read)",
    )
    p(
        "--lora-target-modules",
        nargs="+",
        metavar="NAME",
        help="ModelLink merge: the modules the adapter adapts (Megatron or HF names); an adapter "
        "module outside them is an error, as ModelLink's merge would not load it",
    )
    p(
        "--megatron-path",
        metavar="DIR",
        help="Megatron convert.py: where its code lives; Meshline reads Megatron checkpoints with "
        "its own readers and imports no Megatron checkout, so this is already satisfied",
    )
    p(
        "--tokenizer-model",
        metavar="PATH",
        help="Megatron convert.py: a SentencePiece tokenizer.model; its vocabulary must fit the "
        "model's, and it is carried into the output when the source has no tokenizer",
    )
    p("--fp16", dest="dtype", action="store_const", const="float16", help="same as --dtype float16")
    p("--bf16", dest="dtype", action="store_const", const="bfloat16",
      help="same as --dtype bfloat16")  # fmt: skip


def resolve(args: argparse.Namespace) -> list[str]:
    """Fill load_format / save_format / model / merge_lora from the ModelLink-style flags.

    Raises ValueError naming the flag; returns notes for the user (none today).
    """
    notes: list[str] = []
    if args.model_type is not None and args.model_type.upper() != "GPT":
        raise ValueError(
            f"--model-type {args.model_type}: only GPT (decoder-only) checkpoints are converted"
        )
    if args.checkpoint_type == "meta":
        raise ValueError(
            "--checkpoint-type meta: convert Meta's .pth release to HF first "
            "(transformers' convert_llama_weights_to_hf.py), then pass --checkpoint-type hf"
        )
    if args.loader is not None:
        _set(args, "load_format", LOADERS[args.loader], f"--loader {args.loader}")
    if args.saver is not None:
        _set(args, "save_format", SAVERS[args.saver], f"--saver {args.saver}")
    if args.deepspeed:
        _set(args, "save_format", "native", "--deepspeed")
    if args.model_size is not None:
        name = args.model_size[:-1] if args.model_size.endswith("f") else args.model_size
        _set(args, "model", name, f"--model-size {args.model_size}")
    if args.model_size_type is not None:
        if args.model_size_type not in TYPES:
            raise ValueError(
                f"--type {args.model_size_type}: known sizes {', '.join(TYPES)}; other models: "
                "--model NAME"
            )
        _set(args, "model", TYPES[args.model_size_type], f"--type {args.model_size_type}")
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
    return notes


def _set(args: argparse.Namespace, dest: str, value: str, flag: str) -> None:
    current = getattr(args, dest)
    if current is not None and current != value:
        raise ValueError(
            f"{flag} means --{dest.replace('_', '-')} {value}, but "
            f"--{dest.replace('_', '-')} {current} is given; drop one"
        )
    setattr(args, dest, value)
