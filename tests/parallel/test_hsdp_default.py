"""The HSDP shard-size default, pinned: `--hsdp` without `--hsdp-shard-size` shards over all
data-parallel ranks (one replica), as torchtitan's dp_shard=-1 does, whatever the launcher's
per-node process count (LOCAL_WORLD_SIZE). The loop builds the run's `ParallelDims` once
(`parallel.parallel_dims.build_dims`) and the data-parallel mesh follows it."""

from __future__ import annotations

import os

import pytest

from parallel.parallel_dims import build_dims
from services.trainer.arguments import parse_args
from tests.harness import run_distributed

FLAGS = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
         "--eval-interval", "0", "--train-iters", "1", "--zero-stage", "3"]  # fmt: skip


@pytest.mark.parametrize(
    ("world", "extra", "expected"),
    [
        (8, ["--hsdp"], (1, 8)),
        (8, ["--hsdp", "--hsdp-shard-size", "2"], (4, 2)),
        (8, ["--hsdp", "--tensor-model-parallel-size", "2"], (1, 4)),
        (8, ["--hsdp", "--tensor-model-parallel-size", "2", "--hsdp-shard-size", "2"], (2, 2)),
        (8, [], (1, 8)),
    ],
)
def test_hsdp_default_shards_over_all_data_parallel_ranks(monkeypatch, world, extra, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a launcher's per-node count does not count
    config = parse_args([*FLAGS, *extra]).validate(world)
    dims = build_dims(config, world)
    assert (dims.dp_replicate, dims.dp_shard) == expected
    assert dims.dp == world // config.parallel.model_parallel_size()


def test_only_tp_pp_cp_ep_make_a_run_model_parallel():
    assert not build_dims(parse_args([*FLAGS, "--hsdp"]), 4).is_model_parallel
    for flags in (
        ["--tensor-model-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "2"],
        ["--context-parallel-size", "2"],
        ["--expert-model-parallel-size", "2", "--model", "tiny-mixtral"],
    ):
        assert build_dims(parse_args([*FLAGS, *flags]), 4).is_model_parallel, flags


def _hsdp_mesh(rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[int, ...], float]:
    from services.trainer.loop import Trainer

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one process per "node": the old default's replicas
    trainer = Trainer(parse_args([*FLAGS, "--hsdp"]))
    loss = trainer.train_step().loss
    mesh = trainer.mesh
    return tuple(mesh.mesh_dim_names), tuple(mesh.shape), loss


@pytest.mark.dist
def test_data_parallel_hsdp_mesh_follows_the_run_dims():
    """Pure data parallelism (no TP/PP/CP/EP) takes its mesh from the same dims."""
    results = run_distributed(_hsdp_mesh, 2)
    for names, shape, _ in results:
        assert names == ("dp_replicate", "dp_shard")
        assert shape == (1, 2)
    assert results[0][2] == results[1][2]
