"""`meshline preprocess merge`: join finished preprocess outputs (Megatron's `merge_datasets.py`).

Examples:

    # the shards of `meshline preprocess ... --output-prefix data/corpus --num-shards 3`
    meshline preprocess merge --output-prefix data/corpus --num-shards 3
    # any finished runs (or a directory of them), in this order
    meshline preprocess merge --input data/a data/b --output-prefix data/ab
"""

from __future__ import annotations

import argparse
import sys

from services.preprocess.merge import merge_preprocessed
from services.preprocess.sharding import shard_prefixes


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `meshline preprocess merge`."""
    parser = argparse.ArgumentParser(
        prog="meshline preprocess merge",
        description="Concatenate finished preprocess outputs into one .bin/.idx per key, with a "
        "manifest listing every part (document indices offset, one dtype required).",
        epilog=__doc__.split("Examples:", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input",
        nargs="+",
        metavar="PREFIX",
        help="--output-prefix of each run to merge, in order (a directory: every run in it, sorted)",
    )
    parser.add_argument(
        "--num-shards",
        type=int,
        help="merge the N shards written by `--output-prefix OUT --num-shards N` (instead of --input)",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="outputs are {prefix}_{key}_document.bin/.idx plus {prefix}.manifest.json",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing outputs of the same prefix"
    )
    return parser


def inputs_from_args(args: argparse.Namespace) -> list[str]:
    """The parts to merge: --input, or the shard prefixes of --output-prefix for --num-shards."""
    if (args.input is None) == (args.num_shards is None):
        raise ValueError("pass either --input PREFIX... or --num-shards N (not both, not neither)")
    if args.num_shards is not None:
        if args.num_shards < 2:
            raise ValueError(f"--num-shards: must be >= 2 to merge shards, got {args.num_shards}")
        return shard_prefixes(args.output_prefix, args.num_shards)
    return list(args.input)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0 on success, 1 for bad input."""
    args = build_parser().parse_args(argv)
    try:
        result = merge_preprocessed(
            inputs_from_args(args), args.output_prefix, overwrite=args.overwrite
        )
    except ValueError as exc:
        print(f"meshline preprocess merge: error: {exc}", file=sys.stderr)
        return 1
    for shard in result.outputs:
        print(
            f"{shard.json_key}: {shard.path_prefix} ({shard.documents} documents, {shard.tokens} tokens)"
        )
    print(f"merged {result.parts} parts; manifest {result.manifest_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
