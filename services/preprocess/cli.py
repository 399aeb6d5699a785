"""`meshline preprocess`: ModelLink/Megatron `tools/preprocess_data.py` flags onto `run_preprocess`.

Examples:

    meshline preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePiece --tokenizer-model tok.model --append-eod --workers 2
    meshline preprocess --input alpaca_data.json --output-prefix data/alpaca \\
        --tokenizer-type PretrainedFromHF --tokenizer-name-or-path ./llama-tokenizer \\
        --handler-name GeneralInstructionHandler
    # one pod of an Indexed Job (shard index from $JOB_COMPLETION_INDEX), then the merge
    meshline preprocess --input corpus/ --output-prefix data/corpus --num-shards 3 \\
        --tokenizer-type SentencePiece --tokenizer-model tok.model --append-eod
    meshline preprocess merge --output-prefix data/corpus --num-shards 3
"""

from __future__ import annotations

import argparse
import logging
import sys
from concurrent.futures.process import BrokenProcessPool

from models.templates import TEMPLATES
from models.tokenizer import TOKENIZER_TYPES
from services.common.dataclass_flags import FlagSpec, add_fields, config_values
from services.preprocess.handlers import handler_choices
from services.preprocess.job import PreprocessCancelled, run_preprocess
from services.preprocess.job_config import DATASET_IMPLS, OUTPUT_FORMATS, PreprocessConfig
from services.preprocess.merge_cli import main as merge_main
from services.preprocess.sharding import default_shard_index

GROUPS: dict[str, tuple[str, ...]] = {
    "input": ("input", "hf_datasets_params", "streaming", "json_keys"),
    "tokenizer": (
        "tokenizer_type",
        "tokenizer_name_or_path",
        "tokenizer_model",
        "tokenizer_not_use_fast",
    ),
    "processing": (
        "handler_name",
        "prompt_template",
        "append_eod",
        "seq_length",
        "pack",
        "workers",
        "chunk_size",
        "log_interval",
        "skip_bad_records",
        "max_bad_records",
    ),
    "output": ("output_prefix", "output_format", "dataset_impl", "arrow_shard_mb", "overwrite"),
    "sharding (one pod of many; join with `meshline preprocess merge`)": (
        "num_shards",
        "shard_index",
    ),
}
"""Which `PreprocessConfig` fields are flags, in which --help group (every other field is set only
by gRPC callers)."""


def _specs() -> dict[str, FlagSpec]:
    """What the flags add to the dataclass: spellings, placeholders, choices known at run time."""
    return {
        "input": FlagSpec(required=True, metavar="PATH"),
        "hf_datasets_params": FlagSpec(metavar="JSON_FILE"),
        "json_keys": FlagSpec(aliases=("--json-key",), metavar="KEY"),
        "tokenizer_type": FlagSpec(choices=TOKENIZER_TYPES),
        "handler_name": FlagSpec(
            metavar="NAME",
            help=f"prompt handler: one of {', '.join(handler_choices())}, or module:Class for "
            "your own",
        ),
        "prompt_template": FlagSpec(choices=tuple(sorted(TEMPLATES))),
        "output_prefix": FlagSpec(required=True),
        "output_format": FlagSpec(choices=OUTPUT_FORMATS),
        "dataset_impl": FlagSpec(choices=DATASET_IMPLS),
        # unset: the pod's $JOB_COMPLETION_INDEX (see default_shard_index)
        "shard_index": FlagSpec(extra={"default": None}),
    }


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one flag per `PreprocessConfig` field in GROUPS, its type, default
    and help text from the dataclass."""
    parser = argparse.ArgumentParser(
        prog="meshline preprocess",
        description="Tokenise corpora or instruction data into Megatron .bin/.idx or Arrow shards.",
        epilog=__doc__.split("Examples:", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    specs = _specs()
    for title, names in GROUPS.items():
        add_fields(parser.add_argument_group(title), PreprocessConfig, names, specs)
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """Map parsed flags onto `PreprocessConfig` (validation happens there)."""
    values = config_values(args, PreprocessConfig)
    values["shard_index"] = default_shard_index(args.shard_index, args.num_shards)
    return PreprocessConfig(**values)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshline preprocess`; returns the exit code (0 ok, 1 bad input, 130 cancelled).

    `meshline preprocess merge ...` is handed to `services.preprocess.merge_cli`.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        result = run_preprocess(config_from_args(args))
    except (ValueError, BrokenProcessPool) as exc:
        print(f"meshline preprocess: error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, PreprocessCancelled):
        print("meshline preprocess: interrupted; no output was published", file=sys.stderr)
        return 130
    for shard in result.outputs:
        print(
            f"{shard.json_key}: {shard.path_prefix} ({shard.documents} documents, {shard.tokens} tokens)"
        )
    skipped = f", {result.skipped_records} bad records skipped" if result.skipped_records else ""
    print(
        f"wrote {result.documents} documents, {result.tokens} tokens in {result.elapsed_seconds:.1f}s"
        f"{skipped}; manifest {result.manifest_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
