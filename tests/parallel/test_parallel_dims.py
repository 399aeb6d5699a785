"""ParallelDims validation: sizes against the world and the model, errors naming flags and numbers."""

from __future__ import annotations

import pytest

from parallel.context_parallel import chunk_ids, shard_sequence
from parallel.parallel_dims import ParallelDims
from parallel.pipeline import virtual_chunks

MODEL = dict(num_layers=4, num_heads=4, num_kv_heads=2, ffn=128, vocab=256)


def test_dp_shard_takes_what_the_other_axes_leave():
    dims = ParallelDims(world_size=16, tp=2, pp=2, cp=2)
    assert (dims.dp_shard, dims.dp, dims.model_parallel) == (2, 2, 8)
    assert ParallelDims(world_size=8, tp=2, dp_replicate=2).dp_shard == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(world_size=6, tp=2, pp=2),
            "--tensor-model-parallel-size 2 × --pipeline-model-parallel-size 2 × "
            r"--context-parallel-size 1 = 4 does not divide the world size 6 \(WORLD_SIZE\); "
            "launch a multiple of 4 processes",
        ),
        (
            dict(world_size=12, tp=2, cp=2, dp_replicate=2),
            "--context-parallel-size 2 × data-parallel replicas 2 = 8 does not divide the world "
            "size 12",
        ),
        (
            dict(world_size=4, tp=2, dp_shard=3),
            "× data-parallel shards 3 = 6 must equal the world size 4 .* to get 2",
        ),
        (dict(world_size=2, sequence_parallel=True), "--sequence-parallel needs"),
        (dict(world_size=2, virtual_pp=2), "--pipeline-model-parallel-size > 1"),
    ],
)
def test_bad_sizes_name_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "model", "message"),
    [
        (
            dict(tp=4),
            dict(num_heads=6, num_kv_heads=6, ffn=96, vocab=96),
            r"num_attention_heads 6 is not divisible by --tensor-model-parallel-size 4; choose a "
            r"tensor-parallel size that divides 6 \(1, 2, 3, 6\)",
        ),
        (
            dict(tp=2),
            dict(ffn=127),
            "ffn_hidden_size 127 is not divisible by --tensor-model-parallel-size 2",
        ),
        (dict(tp=2), dict(vocab=255), "vocab_size 255 is not divisible by --tensor-model-parallel"),
        (
            dict(tp=4),
            dict(num_heads=12, num_kv_heads=3, ffn=96, vocab=96),
            r"num_kv_heads 3 and --tensor-model-parallel-size 4: one must divide the other .* "
            r"among 1, 3 or a multiple of 3",
        ),
        (
            dict(pp=4),
            dict(num_layers=6),
            r"num_layers 6 is not divisible by --pipeline-model-parallel-size 4 = 4 pipeline "
            r"stages .* divides 6 \(1, 2, 3, 6\)",
        ),
        (
            dict(pp=2, virtual_pp=4),
            {},
            "num_layers 4 is not divisible by --pipeline-model-parallel-size 2 × 4 virtual chunks "
            "= 8 pipeline stages",
        ),
        (
            dict(cp=2),
            dict(seq_length=30),
            r"--seq-length 30 is not divisible by 2 × --context-parallel-size 2 = 4 .* multiple "
            "of 4",
        ),
    ],
)
def test_model_checks_name_the_sizes(kwargs, model, message):
    world = kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1)
    dims = ParallelDims(world_size=world, **kwargs)
    with pytest.raises(ValueError, match=message):
        dims.check_model(**{**MODEL, **model})


def test_model_checks_pass_a_layout_that_fits():
    ParallelDims(world_size=8, tp=2, pp=2, cp=2).check_model(**MODEL, seq_length=32)


def test_train_config_names_the_flags_for_world_size_and_sequence():
    from services.trainer.arguments import parse_args

    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(ValueError, match="= 4 does not divide the world size 6 \\(WORLD_SIZE\\)"):
        parse_args(flags).validate(6)
    cp = ["--context-parallel-size", "2", "--seq-length", "30"]
    with pytest.raises(ValueError, match="--seq-length 30 is not divisible by 2 × --context"):
        parse_args(cp).validate(2)


def test_kv_heads_may_be_fewer_than_tp_when_tp_is_a_multiple():
    ParallelDims(world_size=4, tp=4).check_model(**{**MODEL, "num_kv_heads": 2})


def test_virtual_chunks_follow_megatron_rule():
    assert virtual_chunks(8, 2, None) == 1
    assert virtual_chunks(8, 2, 2) == 2
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage 3"):
        virtual_chunks(8, 2, 3)


def test_context_parallel_chunks_are_mirrored_and_cover_the_sequence():
    import torch

    x = torch.arange(16).view(1, 16)
    parts = [shard_sequence(x, r, 4) for r in range(4)]
    assert chunk_ids(0, 4) == (0, 7) and chunk_ids(3, 4) == (3, 4)
    assert parts[0].tolist() == [[0, 1, 14, 15]]
    assert sorted(torch.cat(parts, dim=1).flatten().tolist()) == list(range(16))
    with pytest.raises(ValueError, match="--seq-length 16 is not divisible by 2 × --context"):
        shard_sequence(x, 0, 3)
