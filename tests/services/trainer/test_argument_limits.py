"""Bounded parse costs of the trainer's flags (#37 finding 5), checked by what they must not do.

- 100k arguments kept a service thread parsing for 5.5 minutes (argparse's cost grows with the
  square of the option strings): now refused in one linear pass, answered within a second;
- wrong-typed values in a `--config` YAML surfaced as INTERNAL: now INVALID_ARGUMENT naming the
  key and the type wanted, before any worker starts;
- `--dry-run --world-size 10^7` ran on with growing memory: now refused at once, naming the limit.
"""

from __future__ import annotations

import time

import pytest

from services.common.config_values import MAX_ARGS, MAX_FLAGS
from services.common.errors import InvalidArgument
from services.trainer import dry_run_cli
from services.trainer.arguments import parse_args
from services.trainer.servicer import parse_training_flags
from training import dry_run

BASE = ["--model", "tiny-llama", "--mock-data"]


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["x"] * 100_000, rf"100003 arguments: at most {MAX_ARGS}"),
        (["--lr", "0.1"] * 50_000, "arguments: at most"),
        (["--lr", "0.1"] * (MAX_FLAGS + 1), rf"{MAX_FLAGS + 3} flags: at most {MAX_FLAGS}"),
        (["--save", "p" * 100_000], "is 100000 characters"),
    ],
)
def test_oversized_command_lines_are_refused_at_once(argv, pattern):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=pattern):
        parse_args([*BASE, *argv])
    assert time.perf_counter() - started < 1.0


def test_long_value_lists_still_parse_in_linear_time():
    paths = [f"/data/part-{i:05d}" for i in range(15_000)]
    started = time.perf_counter()
    config = parse_args(["--model", "tiny-llama", "--data-path", *paths])
    assert time.perf_counter() - started < 2.0
    assert len(config.data.data_path) == 15_000


def test_100k_args_over_grpc_are_invalid_argument_within_a_second(tmp_path):
    started = time.perf_counter()
    with pytest.raises(InvalidArgument, match="arguments: at most"):
        parse_training_flags([*BASE, *(["--lr", "0.1"] * 50_000)], 1, (tmp_path,))
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(
    ("yaml_text", "pattern"),
    [
        ("micro_batch_size: two\n", r"'micro_batch_size' must be an integer, got str 'two'"),
        ("batch: {micro_batch_size: 2.5}\n", r"'micro_batch_size' must be an integer, got float"),
        ("bf16: 'yes'\n", r"'bf16' must be true or false, got str"),
        ("lr: [1, 2]\n", r"'lr' must be a number, got list"),
        ("data_path: 3\n", r"'data_path' must be a list of strings, got int"),
        ("lr: 1e-3\n", r"'lr' must be a number, got str '1e-3' \(YAML reads 1e-3 as text"),
        ("lr_decay_style: sideways\n", r"'lr_decay_style' must be one of"),
        ("train_iters: true\n", r"'train_iters' must be an integer, got bool"),
    ],
)
def test_wrong_typed_config_values_name_the_key(tmp_path, yaml_text, pattern):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=pattern):
        parse_args([*BASE, "--config", str(path)])
    # Over gRPC the same is INVALID_ARGUMENT (it was INTERNAL), before any worker starts.
    with pytest.raises(InvalidArgument, match=pattern):
        parse_training_flags([*BASE, "--config", str(path)], 1, (tmp_path,))


def test_dry_run_of_ten_million_ranks_is_refused_at_once(capsys):
    started = time.perf_counter()
    code = dry_run_cli.main([*BASE, "--seq-length", "32"], 10**7, None, None)
    assert code == 2 and time.perf_counter() - started < 5.0
    err = capsys.readouterr().err
    assert f"--world-size 10000000: a dry run simulates at most {dry_run.MAX_WORLD_SIZE}" in err
    with pytest.raises(ValueError, match="at most"):
        dry_run.check_world_size(10**7)
