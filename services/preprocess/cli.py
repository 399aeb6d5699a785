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
from services.preprocess.handlers import handler_choices
from services.preprocess.job import PreprocessCancelled, run_preprocess
from services.preprocess.job_config import OUTPUT_FORMATS, PreprocessConfig
from services.preprocess.merge_cli import main as merge_main
from services.preprocess.sharding import SHARD_INDEX_ENV, default_shard_index


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (every flag explained in --help)."""
    parser = argparse.ArgumentParser(
        prog="meshline preprocess",
        description="Tokenise corpora or instruction data into Megatron .bin/.idx or Arrow shards.",
        epilog=__doc__.split("Examples:", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    data = parser.add_argument_group("input")
    data.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="file(s), directory or glob: .json/.jsonl/.jsonl.gz/.parquet/.arrow/.csv/.txt, "
        "a HF dataset saved with save_to_disk, or a datasets script/dir with --hf-datasets-params",
    )
    data.add_argument(
        "--hf-datasets-params",
        metavar="JSON_FILE",
        help="JSON file with name / split / streaming / data_files for datasets.load_dataset",
    )
    data.add_argument(
        "--streaming",
        action="store_true",
        help="stream the HF dataset (local files are always read incrementally)",
    )
    data.add_argument(
        "--json-keys",
        "--json-key",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="record fields to tokenise for pretraining, one dataset each (default: text)",
    )
    tok = parser.add_argument_group("tokenizer")
    tok.add_argument(
        "--tokenizer-type",
        default="PretrainedFromHF",
        choices=["PretrainedFromHF", "SentencePiece"],
        help="PretrainedFromHF: a local HF tokenizer directory; SentencePiece: a .model file",
    )
    tok.add_argument(
        "--tokenizer-name-or-path", help="local HF tokenizer directory (no hub downloads)"
    )
    tok.add_argument("--tokenizer-model", help="SentencePiece .model file")
    tok.add_argument(
        "--tokenizer-not-use-fast",
        action="store_true",
        help="load HF's slow Python tokenizer instead of the fast Rust one",
    )
    proc = parser.add_argument_group("processing")
    proc.add_argument(
        "--handler-name",
        default="GeneralPretrainHandler",
        metavar="NAME",
        help=f"prompt handler: one of {', '.join(handler_choices())}, or module:Class for your own",
    )
    proc.add_argument(
        "--prompt-template",
        choices=sorted(TEMPLATES),
        help="override the instruction handler's prompt template",
    )
    proc.add_argument(
        "--append-eod",
        action="store_true",
        help="end every pretraining document with the EOD token",
    )
    proc.add_argument(
        "--seq-length",
        type=int,
        help="truncate instruction samples to this many tokens; the pack size with --pack",
    )
    proc.add_argument(
        "--pack",
        action="store_true",
        help="group whole samples, in order, into documents of at most --seq-length tokens",
    )
    proc.add_argument(
        "--workers", type=int, default=1, help="tokeniser processes (default 1: in-process)"
    )
    proc.add_argument(
        "--chunk-size", type=int, default=256, help="records handed to a worker at a time"
    )
    proc.add_argument(
        "--log-interval",
        type=int,
        default=10000,
        help="documents between progress lines when stderr is not a terminal",
    )
    proc.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip and count malformed records instead of stopping at the first",
    )
    proc.add_argument(
        "--max-bad-records",
        type=int,
        help="with --skip-bad-records: fail once more than this many were skipped",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--output-prefix",
        required=True,
        help="outputs are {prefix}_{key}_document.bin/.idx (or Arrow shards) plus {prefix}.manifest.json",
    )
    out.add_argument(
        "--output-format",
        default="mmap",
        choices=OUTPUT_FORMATS,
        help="mmap: Megatron indexed dataset; arrow: Arrow IPC shards",
    )
    out.add_argument(
        "--dataset-impl",
        default="mmap",
        choices=["mmap"],
        help="Megatron's on-disk implementation (only mmap; kept for old scripts)",
    )
    out.add_argument(
        "--arrow-shard-mb", type=int, default=256, help="start a new Arrow shard past this size"
    )
    out.add_argument(
        "--overwrite", action="store_true", help="replace existing outputs of the same prefix"
    )
    shard = parser.add_argument_group(
        "sharding (one pod of many; join with `meshline preprocess merge`)"
    )
    shard.add_argument(
        "--num-shards",
        type=int,
        default=1,
        help="split the sorted input files into N contiguous, size-balanced shards; this run "
        "writes one, under {prefix}-shard-IIIII-of-NNNNN",
    )
    shard.add_argument(
        "--shard-index",
        type=int,
        help=f"the shard to write, 0..N-1 (default: ${SHARD_INDEX_ENV}, set in every pod of a "
        "Kubernetes Indexed Job)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """Map parsed flags onto `PreprocessConfig` (validation happens there)."""
    return PreprocessConfig(
        input=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        tokenizer_name_or_path=args.tokenizer_name_or_path,
        tokenizer_model=args.tokenizer_model,
        tokenizer_not_use_fast=args.tokenizer_not_use_fast,
        handler_name=args.handler_name,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        prompt_template=args.prompt_template,
        workers=args.workers,
        chunk_size=args.chunk_size,
        log_interval=args.log_interval,
        dataset_impl=args.dataset_impl,
        streaming=args.streaming,
        hf_datasets_params=args.hf_datasets_params,
        seq_length=args.seq_length,
        pack=args.pack,
        output_format=args.output_format,
        arrow_shard_mb=args.arrow_shard_mb,
        skip_bad_records=args.skip_bad_records,
        max_bad_records=args.max_bad_records,
        overwrite=args.overwrite,
        num_shards=args.num_shards,
        shard_index=default_shard_index(args.shard_index, args.num_shards),
    )


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
