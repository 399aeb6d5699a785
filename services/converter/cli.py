"""`meshline convert`: convert and reshard checkpoints between HF, native and Megatron layouts.

Flags keep ModelLink's names as aliases (`--input-model-dir`, `--output-model-dir`,
`--tensor-model-parallel-size`, `--pipeline-model-parallel-size`, `--type 7B`,
`--params-dtype`, `--deepspeed`, `--load`/`--save`, LoRA merge flags) and Megatron-LM's
`tools/checkpoint/convert.py` flags (`--loader`, `--saver`, `--model-type GPT`, `--model-size`),
so their conversion scripts run with the entry point renamed (`modellink_flags`). Exit codes: 0 done, 1 the conversion failed (a message
names the input and the fix), 2 bad flags, 3 the parity check failed (nothing was written).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from checkpoints.native_format import PPO_MODELS
from checkpoints.registry import DEFAULT_INT4_GROUP, GGUF_TYPES, QUANTIZE_CHOICES
from checkpoints.units import DTYPES
from services.converter import modellink_flags
from services.converter.calibration_flags import add_calibration_flags, calibration_options
from services.converter.job import (
    FORMATS,
    LOAD_FORMATS,
    ConvertOptions,
    Progress,
    VerificationFailed,
    convert,
)

EXIT_FAILED, EXIT_USAGE, EXIT_VERIFY = 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    """The `meshline convert` flag parser."""
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
    p = parser.add_argument
    p(
        "--load-format",
        choices=LOAD_FORMATS,
        default=None,
        help="format of the source checkpoint (default with ModelLink's flags: hf, or megatron "
        "for a --lora-load merge) (deepspeed: a ZeRO-1/2/3 checkpoint, consolidated "
        "to fp32 like zero_to_fp32.py; fsdp: an FSDP SHARDED_STATE_DICT DCP directory or "
        "FULL_STATE_DICT file of an HF model; gguf: a llama.cpp .gguf file of the llama "
        "architecture, dequantized, tokenizer and chat template from its metadata)",
    )
    p(
        "--save-format",
        choices=FORMATS,
        default=None,
        help="format to write (default: megatron; native with --deepspeed)",
    )
    p(
        "--load-dir",
        "--input-model-dir",
        "--load",
        dest="load_dir",
        required=True,
        metavar="DIR",
        help="source directory: an HF model directory, a native save directory (its `latest` "
        "step) or step-XXXXXX directory, a Megatron directory with "
        "latest_checkpointed_iteration.txt, a DeepSpeed directory with `latest` (or its "
        "global_stepN), an FSDP DCP directory / directory with one state-dict file, or a .gguf "
        "file (or a directory holding one)",
    )
    p(
        "--save-dir",
        "--output-model-dir",
        "--save",
        dest="save_dir",
        required=True,
        metavar="DIR",
        help="output directory; written under a temporary name and renamed when complete",
    )
    p(
        "--model",
        metavar="NAME",
        help="model config name (e.g. llama2-7B, tiny-llama); needed when the source records no "
        "config (Megatron checkpoints not written by Meshline); checked against the source's "
        "own config otherwise",
    )
    p(
        "--type",
        dest="model_size_type",
        metavar="SIZE",
        help="ModelLink alias: --type 7B/13B means --model llama2-7B/13B, 30B/65B the LLaMA-1 "
        "llama-33B/65B (other families: use --model)",
    )
    p(
        "--target-tensor-parallel-size",
        "--tensor-model-parallel-size",
        dest="target_tp",
        type=int,
        metavar="N",
        default=1,
        help="tensor-parallel size of a Megatron output (default 1)",
    )
    p(
        "--target-pipeline-parallel-size",
        "--pipeline-model-parallel-size",
        dest="target_pp",
        type=int,
        metavar="N",
        default=1,
        help="pipeline-parallel size of a Megatron output (default 1)",
    )
    p(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        metavar="N",
        default=None,
        help="layers per virtual pipeline chunk of a Megatron output (interleaved schedule); "
        "files then hold model0, model1, ...",
    )
    p(
        "--make-vocab-size-divisible-by",
        type=int,
        metavar="N",
        default=128,
        help="Megatron outputs pad the vocabulary to a multiple of this times the TP size "
        "(default 128)",
    )
    p(
        "--load-iteration",
        type=int,
        metavar="N",
        default=None,
        help="iteration of a Megatron source, or global step of a DeepSpeed one, to read "
        "(default: latest_checkpointed_iteration.txt / latest)",
    )
    p(
        "--lora-load",
        dest="lora_dir",
        metavar="DIR",
        help="LoRA to merge (needs --merge-lora): a peft adapter directory, or a Megatron/"
        "ModelLink LoRA checkpoint (latest_checkpointed_iteration.txt + mp_rank_* files, any "
        "TP/PP; merged per TP rank)",
    )
    p(
        "--lora-r",
        type=int,
        metavar="R",
        default=None,
        help="LoRA rank of a Megatron LoRA checkpoint whose args lack lora_r",
    )
    p(
        "--lora-alpha",
        type=float,
        metavar="A",
        default=None,
        help="LoRA alpha of a Megatron LoRA checkpoint whose args lack lora_alpha",
    )
    p(
        "--merge-lora",
        action="store_true",
        help="fold the --lora-load adapter into the weights: W + (alpha/r)·B·A (implied by "
        "--lora-load, as in ModelLink's merge script)",
    )
    p(
        "--dtype",
        "--params-dtype",
        dest="dtype",
        choices=list(DTYPES),
        default=None,
        help="dtype of the saved weights (default: keep the source's)",
    )
    p(
        "--verify",
        dest="verify",
        action="store_true",
        default=None,
        help="always run the parity check (by default it runs whenever two float32 copies of the "
        "model fit in half the available memory): source and output on a fixed prompt, failing "
        "(exit 3, no output) if logits differ by more than the tolerance",
    )
    p(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the parity check",
    )
    p(
        "--verify-tolerance",
        type=float,
        metavar="X",
        default=None,
        help="largest allowed absolute logit difference (default 1e-4 for fp32 outputs, 2e-2 "
        "for fp16/bf16)",
    )
    p("--overwrite", action="store_true", help="replace a non-empty --save-dir")
    p(
        "--max-shard-size-mb",
        type=int,
        metavar="MB",
        default=2048,
        help="HF outputs larger than this are split into shards with an index (default 2048)",
    )
    p(
        "--gguf-type",
        choices=GGUF_TYPES,
        default=None,
        help="ggml type of a --save-format gguf output's matrices and token embedding (norms "
        "stay F32; default: F32/F16/BF16 by --dtype); Q8_0 and Q4_0 round the weights, so the "
        "automatic parity check is skipped for them",
    )
    p(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="with --save-format quantized: weight-only round-to-nearest quantization of the "
        "decoder layers' Linear weights (norms kept; the token embedding and output head int8 "
        "with one scale per row unless --keep-embedding): int8 one symmetric scale per output "
        "channel, int4 one per --group-size inputs; the checkpoint records its scheme; serving "
        "computes on the codes, other stages read it dequantized",
    )
    p(
        "--group-size",
        type=int,
        metavar="N",
        default=None,
        help=f"inputs sharing one scale (default: per output channel for int8, "
        f"{DEFAULT_INT4_GROUP} for int4)",
    )
    p(
        "--quantize-affine",
        action="store_true",
        help="affine codes (a zero point per group over [min, max]) instead of symmetric ones",
    )
    p(
        "--ppo-model",
        choices=PPO_MODELS,
        default=None,
        help="of a `meshline train --stage ppo` checkpoint (native), which model to write: "
        "policy (the trained language model, the default) or critic (the value model: a "
        "reward-model-style network with a scalar head, written as HF "
        "...ForSequenceClassification with one label, or native/megatron)",
    )
    p(
        "--keep-embedding",
        action="store_true",
        help="with --quantize: keep the token embedding and output head in --dtype instead of "
        "int8 codes with one scale per row",
    )
    add_calibration_flags(p)
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
    model = args.model
    if args.max_shard_size_mb < 1:
        raise ValueError("--max-shard-size-mb must be >= 1")
    return ConvertOptions(
        load_format=args.load_format,
        save_format=args.save_format,
        load_dir=Path(args.load_dir),
        save_dir=Path(args.save_dir),
        model=model,
        target_tp=args.target_tp,
        target_pp=args.target_pp,
        layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
        lora_dir=Path(args.lora_dir) if args.lora_dir else None,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        dtype=args.dtype,
        verify=args.verify,
        verify_tolerance=args.verify_tolerance,
        load_iteration=args.load_iteration,
        overwrite=args.overwrite,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        max_shard_bytes=args.max_shard_size_mb * 1024**2,
        gguf_type=args.gguf_type,
        quantize=args.quantize,
        group_size=args.group_size,
        quantize_affine=args.quantize_affine,
        keep_embedding=args.keep_embedding,
        tokenizer_model=Path(args.tokenizer_model) if args.tokenizer_model else None,
        lora_target_modules=tuple(args.lora_target_modules or ()),
        ppo_model=args.ppo_model,
        **calibration_options(args),
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
