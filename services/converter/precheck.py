"""`meshline convert`'s layout check before anything imports torch.

A `--target-tensor-parallel-size` / `--target-pipeline-parallel-size` that the source's heads or
layers rule out is refused from the source's config file alone, in well under a second: `meshline`
runs `precheck` before it imports the converter (whose readers and writers import torch). What
this cannot decide (a source format without a JSON config, flags the converter's own parser
refuses) it leaves to `job.check_target_layout`, which runs again before any weight is read.
"""

from __future__ import annotations

import sys
from pathlib import Path

from checkpoints.config_files import read_model_config
from checkpoints.registry import FORMATS
from models.parallel_plan import CONVERT_FLAGS, check_model_split
from services.common.quiet_parser import QuietParser
from services.converter import modellink_flags

EXIT_FAILED = 1
"""What `meshline convert` exits with when `convert` refuses the job (cli.EXIT_FAILED)."""


def _layout_flags() -> QuietParser:
    parser = QuietParser()
    p = parser.add_argument
    p("--load-format", default=None)
    p("--save-format", default=None)
    p("--load-dir", "--input-model-dir", "--load", dest="load_dir", default=None)
    p("--target-tensor-parallel-size", "--tensor-model-parallel-size", dest="target_tp",
      type=int, default=1)  # fmt: skip
    p("--target-pipeline-parallel-size", "--pipeline-model-parallel-size", dest="target_pp",
      type=int, default=1)  # fmt: skip
    p("--model", default=None)
    p("--dtype", "--params-dtype", default=None)
    p("--lora-load", dest="lora_dir", default=None)
    p("--lora-target-modules", nargs="+", default=None)
    p("--merge-lora", action="store_true")
    # --loader, --saver, --deepspeed, --type: they pick the formats and the model
    modellink_flags.add_flags(parser)
    return parser


def precheck(argv: list[str]) -> int | None:
    """Exit code 1 after one stderr line (as `meshline convert` prints a refused job) when the
    target layout cannot split the source's model; None: nothing refused here."""
    try:
        args, _ = _layout_flags().parse_known_args(argv)
        modellink_flags.resolve(args)
    except ValueError:
        return None  # the converter's own parser reports it
    tp, pp = args.target_tp, args.target_pp
    target = FORMATS.get(args.save_format)
    if args.load_dir is None or target is None or not target.model_parallel:
        return None
    if tp < 1 or pp < 1:
        return None
    config = read_model_config(args.load_format, Path(args.load_dir))
    if config is None:
        return None
    try:
        check_model_split(config, tp=tp, pp=pp, flags=CONVERT_FLAGS)
    except ValueError as exc:
        print(f"meshline convert: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return None
