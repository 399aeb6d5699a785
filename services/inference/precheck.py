"""`meshline serve inference`'s layout check before anything imports torch.

A `--tensor-parallel-size` / `--pipeline-parallel-size` that the checkpoint's heads or layers
rule out is refused from its config file alone, in well under a second: `meshline serve` runs
`precheck` before it imports the service (whose engine imports torch). Whatever this cannot
decide here (a format without a JSON config, an unparsable command line) it leaves to the full
check, `parallel_serving.check_layout`, which runs again before any rank is spawned.
"""

from __future__ import annotations

import sys
from pathlib import Path

from checkpoints.config_files import read_model_config
from checkpoints.registry import AUTO, detect_format
from models.parallel_plan import SERVE_FLAGS, check_model_split
from services.common.dataclass_flags import add_fields
from services.common.quiet_parser import QuietParser
from services.inference.config import FLAG_SPECS, InferenceServiceConfig

LAYOUT_FLAGS = ("load", "load_format", "tensor_parallel_size", "pipeline_parallel_size")
"""The `InferenceServiceConfig` fields whose flags decide the layout."""


def _layout_flags() -> QuietParser:
    """These fields' flags as the service's parser spells, types and defaults them."""
    parser = QuietParser()
    add_fields(parser, InferenceServiceConfig, LAYOUT_FLAGS, FLAG_SPECS)
    return parser


def precheck(argv: list[str]) -> int | None:
    """Exit code 2 after one stderr line (as `inference serve` prints it) when the layout flags
    cannot split the `--load` checkpoint's model; None: nothing refused here."""
    try:
        args, _ = _layout_flags().parse_known_args(argv)
    except ValueError:
        return None  # the service's own parser reports it
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if args.load is None or tp < 1 or pp < 1 or tp * pp == 1:
        return None
    directory = Path(args.load)
    try:
        fmt = detect_format(directory) if args.load_format == AUTO else args.load_format
    except (OSError, ValueError):
        return None
    config = read_model_config(fmt, directory)
    if config is None:
        return None
    try:
        check_model_split(config, tp=tp, pp=pp, flags=SERVE_FLAGS)
    except ValueError as exc:
        print(f"inference serve: {exc}", file=sys.stderr)
        return 2
    return None
