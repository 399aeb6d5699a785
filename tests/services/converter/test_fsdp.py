"""FSDP checkpoints of an HF model — a 2-process FSDP2 job's SHARDED_STATE_DICT (DCP, nested under
"model" with optimizer state beside it, as Accelerate saves) and FULL_STATE_DICT (one torch file) —
convert with `--load-format fsdp` to HF weights equal to the gathered parameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.converter.job import ConvertOptions, convert
from tests.harness import run_distributed
from tests.services.converter.conftest import hf_llama_gqa


def _train_and_save(rank: int, world_size: int, root: str) -> dict[str, np.ndarray]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = hf_llama_gqa(num_layers=2).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    sharded = get_model_state_dict(model)
    assert all(isinstance(t, DTensor) for t in sharded.values())  # really sharded
    state = {"model": sharded, "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=Path(root) / "pytorch_model_fsdp_0")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        model.config.save_pretrained(root)
        (Path(root) / "full").mkdir()
        torch.save(full, Path(root) / "full" / "pytorch_model_fsdp.bin")
    return {name: tensor.detach().numpy().copy() for name, tensor in full.items()}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("dist")
def test_fsdp_sharded_and_full_state_dicts_convert_to_hf(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    saved = run_distributed(_train_and_save, 2, str(root))[0]
    expected = {name: torch.from_numpy(array) for name, array in saved.items()}
    for source in (root / "pytorch_model_fsdp_0", root / "full"):
        out = tmp_path / f"hf-{source.name}"
        report = convert(ConvertOptions("fsdp", "hf", source, out, verify=True))
        assert report.verify is not None and report.verify.max_abs_logit_diff == 0.0
        got = load_file(out / "model.safetensors")
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (source.name, name)
