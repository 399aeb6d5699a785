"""The HSDP shard-size default, pinned: `--hsdp` without `--hsdp-shard-size` shards over the
data-parallel ranks of one node and replicates across nodes (FSDP's HYBRID_SHARD), taking the
processes per node from the launcher (LOCAL_WORLD_SIZE); with no launcher count, or one that does
not tile the data-parallel ranks, it shards over all of them. The loop builds the run's
`ParallelDims` once (`parallel.parallel_dims.build_dims`) and the data-parallel mesh follows it."""

from __future__ import annotations

import os

import pytest

from parallel.parallel_dims import build_dims
from services.trainer.arguments import parse_args
from tests.harness import run_distributed

FLAGS = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
         "--eval-interval", "0", "--train-iters", "1", "--zero-stage", "3"]  # fmt: skip


@pytest.mark.parametrize(
    ("world", "local", "extra", "expected"),
    [
        (8, "4", ["--hsdp"], (2, 4)),  # 2 nodes x 4: shard in a node, 2 replicas
        (8, "8", ["--hsdp"], (1, 8)),  # one node: one replica
        (8, None, ["--hsdp"], (1, 8)),  # no launcher count: all data-parallel ranks
        (8, "3", ["--hsdp"], (1, 8)),  # a count that does not tile: all ranks
        (8, "4", ["--hsdp", "--hsdp-shard-size", "2"], (4, 2)),  # explicit size wins
        (8, "4", ["--hsdp", "--tensor-model-parallel-size", "2"], (2, 2)),  # 2 dp ranks a node
        (8, "2", ["--hsdp", "--tensor-model-parallel-size", "4"], (1, 2)),  # TP spans nodes
        (8, "4", [], (1, 8)),  # no --hsdp: never replicated
    ],
)
def test_hsdp_default_shards_within_a_node(monkeypatch, world, local, extra, expected):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    config = parse_args([*FLAGS, *extra]).validate(world)
    dims = build_dims(config, world)
    assert (dims.dp_replicate, dims.dp_shard) == expected
    assert dims.dp == world // config.parallel.model_parallel_size()


def test_explicit_local_world_size_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    config = parse_args([*FLAGS, "--hsdp"]).validate(8)
    assert (build_dims(config, 8, local_world_size=2).dp_replicate) == 4


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
    from training.loop import Trainer

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one process per "node": two nodes, two replicas
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
        assert shape == (2, 1)
    assert results[0][2] == results[1][2]
