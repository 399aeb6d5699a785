"""`parallel.config.ParallelConfig`: the trainer's parallel flags map onto it in one place, and
`build_dims` reads it whether given directly or through a training config."""

from __future__ import annotations

from dataclasses import fields

from parallel.config import ParallelConfig
from parallel.parallel_dims import build_dims
from services.trainer.arguments import parse_args
from training.run_sections import ParallelSection

FLAGS = [
    "--model", "tiny-llama", "--mock-data", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--pipeline-model-parallel-size", "2",
    "--decoder-first-pipeline-num-layers", "1", "--pipeline-schedule", "gpipe",
    "--overlap-grad-reduce", "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--use-distributed-optimizer",
]  # fmt: skip


def test_every_parallel_config_field_is_a_trainer_flag_with_its_default() -> None:
    section = {f.name: f for f in fields(ParallelSection)}
    for f in fields(ParallelConfig):
        assert f.name in section, f"ParallelSection has no {f.name}"
        assert getattr(ParallelSection(), f.name) == getattr(ParallelConfig(), f.name), f.name


def test_the_trainer_config_maps_its_flags_onto_the_parallel_config() -> None:
    config = parse_args(FLAGS)
    par = config.parallel_config()
    assert isinstance(par, ParallelConfig)
    for f in fields(ParallelConfig):
        assert getattr(par, f.name) == getattr(config.parallel, f.name), f.name
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size) == (2, 2)
    assert (par.pipeline_schedule, par.recompute_granularity, par.zero_stage) == (
        "gpipe",
        "full",
        1,
    )
    assert par.model_parallel_size() == config.parallel.model_parallel_size() == 4


def test_build_dims_reads_a_parallel_config_or_a_config_that_has_one() -> None:
    config = parse_args(FLAGS)
    direct = build_dims(config.parallel_config(), 8)
    assert direct == build_dims(config, 8)
    assert (direct.tp, direct.pp, direct.dp, direct.sequence_parallel) == (2, 2, 2, True)
