"""A native checkpoint saved by a 2-process FSDP2 (ZeRO-3) job, its parameters and optimizer
state sharded over the ranks, converts to full HF weights equal to the gathered parameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.hf_adapters import to_hf
from models.registry import get_config
from services.converter.job import ConvertOptions, convert
from tests.harness import run_distributed

CONFIG = dict(vocab_size=96, hidden_size=32, num_layers=2, max_position_embeddings=32)


def _train_and_save(rank: int, world_size: int, root: str) -> dict[str, np.ndarray]:
    from torch.distributed.tensor import DTensor

    from models import build_model
    from parallel.data_parallel import apply_data_parallel, build_dp_mesh
    from training.checkpoint import CheckpointManager, TrainState

    config = get_config("tiny-llama-gqa", **CONFIG)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model = apply_data_parallel(model, build_dp_mesh(world_size, 1, world_size), zero_stage=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank)
    )
    model(ids).float().logsumexp(-1).mean().backward()
    optimizer.step()
    manager = CheckpointManager(Path(root), model_config=config.to_dict())
    manager.save(1, TrainState(model, optimizer, save_rng=False))
    full = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)  # really sharded over the two ranks
        # numpy, not tensors: tensors would travel back through shared memory the child frees
        full[name] = param.full_tensor().detach().numpy().copy()
    return full


@pytest.mark.dist
@pytest.mark.slow
def test_zero3_checkpoint_consolidates_to_full_weights(tmp_path):
    saved = run_distributed(_train_and_save, 2, str(tmp_path / "run"))[0]
    params = {name: torch.from_numpy(array) for name, array in saved.items()}
    report = convert(ConvertOptions("native", "hf", tmp_path / "run", tmp_path / "hf", verify=True))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0.0
    config = get_config("tiny-llama-gqa", **CONFIG)
    expected = to_hf(params, config)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
