"""The shared request-range check and the `serve` flags derived from a service's config."""

from __future__ import annotations

import argparse

import pytest

from meshline.evaluator.v1 import evaluator_pb2
from services.common.errors import InvalidArgument, Validator
from services.common.field_checks import check_range, check_ranges
from services.converter.config import ConverterServiceConfig
from services.converter.config import add_flags as converter_flags
from services.converter.config import from_args as converter_config
from services.evaluator.config import add_flags as evaluator_flags
from services.evaluator.config import from_args as evaluator_config


def test_check_range_names_the_field_bound_and_value():
    request = evaluator_pb2.StartEvaluationRequest(batch_size=0, limit=0, num_fewshot=3)
    check = Validator()
    check_range(check, request, "batch_size", 1, 8, " (the server's --max-batch-size)")
    check_ranges(check, request, {"limit": (1, None), "num_fewshot": (0, 64), "seed": (0, 1)})
    with pytest.raises(InvalidArgument) as info:
        check.raise_if_any()
    assert info.value.violations == [
        ("batch_size", "must be in [1, 8] (the server's --max-batch-size), got 0"),
        ("limit", "must be >= 1, got 0"),
    ]  # num_fewshot in range, seed unset


def _parse(add_flags, argv):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(argv)


def test_serve_flags_come_from_the_config_and_build_it(tmp_path):
    args = _parse(converter_flags, ["--data-root", str(tmp_path), "--max-parallel-size", "8"])
    assert converter_config(args) == ConverterServiceConfig(
        data_roots=(tmp_path,), max_parallel_size=8
    )
    default = converter_config(_parse(converter_flags, ["--data-root", str(tmp_path)]))
    assert default.max_parallel_size == ConverterServiceConfig.max_parallel_size == 64
    with pytest.raises(ValueError, match="--max-parallel-size must be >= 1, got 0"):
        converter_config(_parse(converter_flags, ["--max-parallel-size", "0"]))
    argv = ["--data-root", str(tmp_path), "--max-batch-size", "3", "--allow-unsafe-code-execution"]
    config = evaluator_config(_parse(evaluator_flags, argv))
    assert (config.max_batch_size, config.max_new_tokens_limit) == (3, 4096)
    assert config.allow_unsafe_code_execution
    assert config.output_root == tmp_path.resolve() / "runs" / "eval"
    empty = evaluator_config(_parse(evaluator_flags, [*argv, "--output-root", ""]))
    assert empty.output_root == config.output_root  # an empty --output-root is the default
