"""Checkpoints across data-parallel layouts, on real gloo groups.

* A DP2 run (ZeRO-3 saving asynchronously) resumed in fresh processes under the same layout (ZeRO-1, ZeRO-3) ends bit-identical
  to the uninterrupted run, and each rank gets its own RNG state back.
* Any layout loads any other: DP2 ZeRO-3 ↔ DP2 ZeRO-0 ↔ DP1, DP1 → DP2 ZeRO-1/ZeRO-3. Loaded
  parameters equal the saved ones exactly; the continued runs (which then reduce gradients in a
  different order) match the saving layout's own continuation within the tolerances of
  test_data_parallel (1e-5 relative on losses, 1e-4 absolute on parameters).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import device
from parallel.data_parallel import apply_data_parallel, build_dp_mesh, wrap_optimizer
from tests.harness import run_distributed
from tests.parallel.test_data_parallel_model import (
    build_optimizer,
    build_tiny_model,
    full_parameters,
    train_steps,
)
from training.checkpoint import CheckpointManager, TrainState

SAVE_AT, END = 3, 6
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4
SAVED_LAYOUTS = ("zero0", "zero1", "zero3")
# (layout to train under after loading, checkpoint to load)
CROSS_LOADS = (
    ("zero3", "zero3"),
    ("zero1", "zero1"),
    ("zero0", "zero3"),
    ("zero3", "zero0"),
    ("zero1", "dp1"),
    ("zero3", "dp1"),
)


def _numpy(params: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in params.items()}


def _dp_state(world_size: int, layout: str, seed: int) -> TrainState:
    stage = int(layout.removeprefix("zero"))
    mesh = build_dp_mesh(world_size, 1, world_size)
    model = apply_data_parallel(build_tiny_model(seed), mesh, zero_stage=stage)
    optimizer = wrap_optimizer(build_optimizer(model), model, mesh, zero_stage=stage)
    return TrainState(model, optimizer)


def _save_runs(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for layout in SAVED_LAYOUTS:
        state = _dp_state(world_size, layout, seed=0)
        train_steps(state.model, state.optimizer, range(SAVE_AT), dp_rank=rank, dp_size=world_size)
        saved = _numpy(full_parameters(state.model))
        device.seed_everything(100, rank_offset=rank)
        state.extra["consumed_samples"] = 8 * SAVE_AT
        # ZeRO-3 saves asynchronously: training continues while a background thread writes.
        manager = CheckpointManager(Path(root) / layout, async_save=layout == "zero3")
        manager.save(SAVE_AT, state)
        draw = torch.rand(3).tolist()
        losses = train_steps(
            state.model, state.optimizer, range(SAVE_AT, END), dp_rank=rank, dp_size=world_size
        )
        manager.wait()
        results[layout] = (saved, losses, _numpy(full_parameters(state.model)), draw)
    return results


def _load_runs(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for layout, source in CROSS_LOADS:
        state = _dp_state(world_size, layout, seed=77)  # differs from the saved weights
        assert CheckpointManager(Path(root) / source).load("latest", state) == SAVE_AT
        assert state.extra == {"consumed_samples": 8 * SAVE_AT}
        draw = torch.rand(3).tolist()
        loaded = _numpy(full_parameters(state.model))
        losses = train_steps(
            state.model, state.optimizer, range(SAVE_AT, END), dp_rank=rank, dp_size=world_size
        )
        results[(layout, source)] = (loaded, losses, _numpy(full_parameters(state.model)), draw)
    return results


def _dp1_run(root: Path) -> tuple:
    model = build_tiny_model()
    state = TrainState(model, build_optimizer(model))
    train_steps(state.model, state.optimizer, range(SAVE_AT))
    saved = _numpy(full_parameters(model))
    state.extra["consumed_samples"] = 8 * SAVE_AT
    CheckpointManager(root / "dp1").save(SAVE_AT, state)
    losses = train_steps(state.model, state.optimizer, range(SAVE_AT, END))
    return saved, losses, _numpy(full_parameters(model))


def _close(name, losses, params, ref_losses, ref_params):
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    assert rel <= LOSS_RTOL, f"{name}: losses off by {rel:.2e} relative"
    worst = max(np.abs(params[k] - ref_params[k]).max() for k in ref_params)
    assert worst <= PARAM_ATOL, f"{name}: parameters off by {worst:.2e}"


def _equal(name, params, ref_params):
    assert params.keys() == ref_params.keys()
    for key in ref_params:
        assert np.array_equal(params[key], ref_params[key]), f"{name}: {key} differs"


@pytest.mark.dist
@pytest.mark.slow
def test_dp_checkpoints_resume_bit_identical_and_load_across_layouts(tmp_path):
    saved = run_distributed(_save_runs, 2, str(tmp_path))
    dp1 = _dp1_run(tmp_path)
    loaded = run_distributed(_load_runs, 2, str(tmp_path))
    reference = {**{k: v[:3] for k, v in saved[0].items()}, "dp1": dp1}

    # DP2 -> DP1 (single process, no process group).
    model = build_tiny_model(seed=77)
    state = TrainState(model, build_optimizer(model))
    CheckpointManager(tmp_path / "zero3").load("latest", state)
    _equal("zero3 -> dp1 load", _numpy(full_parameters(model)), reference["zero3"][0])
    losses = train_steps(state.model, state.optimizer, range(SAVE_AT, END))
    _close("zero3 -> dp1", losses, _numpy(full_parameters(model)), *reference["zero3"][1:])

    for (layout, source), (params_at_load, losses, params, _draw) in loaded[0].items():
        name = f"{source} -> {layout}"
        _equal(f"{name} load", params_at_load, reference[source][0])
        if layout == source:
            assert losses == reference[source][1], f"{name}: resumed losses differ"
            _equal(f"{name} resume", params, reference[source][2])
        else:
            _close(name, losses, params, *reference[source][1:])
    # Each rank's RNG comes back as that rank saved it (and the ranks' streams differ).
    for layout in ("zero1", "zero3"):
        draws = [saved[rank][layout][3] for rank in range(2)]
        assert draws[0] != draws[1]
        for rank in range(2):
            assert loaded[rank][(layout, layout)][3] == draws[rank], f"rank {rank} RNG ({layout})"
