"""`meshline convert`'s GPTQ flags (--quantize-method and the calibration set), mapped onto the
ConvertOptions fields of the same names; defaults and bounds live there."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoints.registry import QUANTIZE_METHODS
from kernels.gptq import DEFAULT_PERCDAMP
from services.converter.options import (
    DEFAULT_CALIBRATION_SAMPLES,
    DEFAULT_CALIBRATION_SEQ_LEN,
    MAX_CALIBRATION_SAMPLES,
    MAX_CALIBRATION_TOKENS,
)


def add_calibration_flags(add: Callable[..., Any]) -> None:
    """Adds the flags with `add` (the parser's or a group's add_argument)."""
    add(
        "--quantize-method",
        "--method",
        dest="quantize_method",
        choices=QUANTIZE_METHODS,
        default="rtn",
        help="with --quantize: how the decoder layers' codes are chosen: rtn (round to nearest, "
        "the default) or gptq (GPTQ, calibrated layer by layer on --calibration-data; the "
        "embedding and head stay round to nearest)",
    )
    add(
        "--calibration-data",
        metavar="PREFIX",
        default=None,
        help="with --quantize-method gptq: a Megatron token shard (PREFIX.bin/.idx, as `meshline "
        "preprocess` writes) tokenized with this model's tokenizer",
    )
    add(
        "--calibration-samples",
        type=int,
        metavar="N",
        default=DEFAULT_CALIBRATION_SAMPLES,
        help=f"GPTQ calibration windows, spread evenly over the shard (default "
        f"{DEFAULT_CALIBRATION_SAMPLES}, at most {MAX_CALIBRATION_SAMPLES}; samples × length at "
        f"most {MAX_CALIBRATION_TOKENS})",
    )
    add(
        "--calibration-seq-len",
        type=int,
        metavar="TOKENS",
        default=DEFAULT_CALIBRATION_SEQ_LEN,
        help=f"tokens per GPTQ calibration window (default {DEFAULT_CALIBRATION_SEQ_LEN}, at most "
        "the model's context)",
    )
    add(
        "--gptq-act-order",
        action="store_true",
        help="GPTQ rounds the columns of largest input energy first (groups' scales fixed from "
        "the original weights)",
    )
    add(
        "--gptq-damp",
        type=float,
        metavar="FRACTION",
        default=DEFAULT_PERCDAMP,
        help=f"GPTQ dampening of the Hessian, a fraction of its mean diagonal (default "
        f"{DEFAULT_PERCDAMP})",
    )


def calibration_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ConvertOptions fields the flags set."""
    return {
        "quantize_method": args.quantize_method,
        "calibration_data": Path(args.calibration_data) if args.calibration_data else None,
        "calibration_samples": args.calibration_samples,
        "calibration_seq_len": args.calibration_seq_len,
        "gptq_act_order": args.gptq_act_order,
        "gptq_damp": args.gptq_damp,
    }
