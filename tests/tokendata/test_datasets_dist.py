"""Sample indices are built once: rank 0 of a gloo group (others wait), or under a file lock."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.harness import run_distributed
from tokendata.indexed import IndexedDatasetWriter


def _ranks_build(rank: int, world_size: int, prefix: str, root: str) -> dict:
    import hashlib

    import torch.distributed as dist

    from tokendata.datasets import DataConfig, build_datasets
    from tokendata.datasets import gpt as gpt_module

    calls = {"n": 0}
    real = gpt_module.build_gpt_indices

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    gpt_module.build_gpt_indices = counting
    info = {"eod_id": 2, "pad_id": 0}
    out: dict = {}

    config = DataConfig(data_path=[prefix], split="90,10,0", cache_dir=f"{root}/group")
    train, valid, _ = build_datasets(config, info, 16, 3, (64, 8, 0), group=dist.group.WORLD)
    out["group_calls"] = calls["n"]
    out["digest"] = hashlib.sha256(
        b"".join(
            np.asarray(a).tobytes()
            for a in (train.sample_index, train.shuffle_index, valid.shuffle_index)
        )
    ).hexdigest()
    out["first_sample"] = train[0]["input_ids"].tolist()

    calls["n"] = 0
    locked = DataConfig(data_path=[prefix], split="1,0,0", cache_dir=f"{root}/lock")
    build_datasets(locked, info, 16, 4, (64, 0, 0))
    out["lock_calls"] = calls["n"]

    empty = DataConfig(data_path=[prefix], split="969,30,1", cache_dir=f"{root}/bad")
    try:
        build_datasets(empty, info, 16, 3, (8, 2, 2), group=dist.group.WORLD)
        out["error"] = None
    except (ValueError, RuntimeError) as error:
        out["error"] = str(error)
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_rank_zero_builds_others_load_and_errors_reach_every_rank(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    prefix = tmp_path / "d_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(30):
            writer.add_document([*rng.integers(3, 300, size=int(rng.integers(2, 40))).tolist(), 2])
    results = run_distributed(_ranks_build, 2, str(prefix), str(tmp_path))
    assert [r["group_calls"] for r in results] == [2, 0]  # train + valid, on rank 0 only
    assert results[0]["digest"] == results[1]["digest"]
    assert results[0]["first_sample"] == results[1]["first_sample"]
    assert sum(r["lock_calls"] for r in results) == 1
    for r in results:
        assert r["error"] is not None and "test split" in r["error"]
