"""Native checkpoints (single process): atomic publication, keep-last-K, bit-identical resume,
async save, clear errors for missing/corrupted checkpoints, and a SIGTERM last-gasp save.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kernels import device
from tests.harness import run_distributed
from tests.parallel.test_data_parallel_model import (
    build_optimizer,
    build_tiny_model,
    full_parameters,
    train_steps,
)
from training.checkpoint import CheckpointManager, LastGasp, TrainState

REPO = Path(__file__).resolve().parents[3]


def _fresh_state(seed: int = 0) -> TrainState:
    model = build_tiny_model(seed)
    optimizer = build_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return TrainState(model, optimizer, scheduler, loss_scaler=scaler)


def _train(state: TrainState, steps: range) -> list[float]:
    return train_steps(
        state.model, state.optimizer, steps, scheduler=state.scheduler, random_batches=True
    )


def test_bit_identical_resume(tmp_path):
    device.seed_everything(7)
    straight = _fresh_state()
    straight_losses = _train(straight, range(6))

    device.seed_everything(7)
    first = _fresh_state()
    first_losses = _train(first, range(3))
    first.extra.update(step=3, consumed_samples=24)
    first.loss_scaler.scale(torch.ones(()))  # materialise the scale, then move it
    first.loss_scaler.update(new_scale=300.0)
    manager = CheckpointManager(tmp_path, model_config={"name": "tiny"})
    manager.save(3, first)

    # A different model init and RNG stream: everything must come from the checkpoint.
    device.seed_everything(12345)
    resumed = _fresh_state(seed=99)
    assert CheckpointManager(tmp_path).load("latest", resumed) == 3
    assert resumed.extra == {"step": 3, "consumed_samples": 24}
    resumed_losses = _train(resumed, range(3, 6))

    assert first_losses + resumed_losses == straight_losses
    expected = full_parameters(straight.model)
    for name, value in full_parameters(resumed.model).items():
        assert torch.equal(value, expected[name]), f"{name} differs after resume"
    assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()
    assert resumed.loss_scaler.get_scale() == 300.0
    assert json.loads((tmp_path / "step-000003" / "config.json").read_text()) == {"name": "tiny"}


def test_keep_last_and_atomic_latest(tmp_path, monkeypatch):
    state = _fresh_state()
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 5):
        manager.save(step, state)
    assert manager.steps() == [3, 4]
    assert manager.latest() == 4

    real_save = dcp.save

    def crash(*args, **kwargs):
        real_save(*args, **kwargs)  # the tensors are all written, the step is not yet published
        raise OSError("disk full (simulated crash mid-save)")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        manager.save(5, state)
    monkeypatch.undo()
    # The half-written step is not a checkpoint: latest and the step list are unchanged.
    assert (tmp_path / "step-000005.tmp").is_dir()
    assert manager.steps() == [3, 4] and manager.latest() == 4
    assert CheckpointManager(tmp_path).load("latest", _fresh_state()) == 4
    manager.save(6, state)
    assert not (tmp_path / "step-000005.tmp").exists(), "a stale .tmp is cleaned by the next save"
    assert manager.steps() == [4, 6] and manager.latest() == 6


def test_async_save_snapshots_the_state(tmp_path):
    state = _fresh_state()
    _train(state, range(2))
    snapshot = full_parameters(state.model)
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(2, state)
    _train(state, range(2, 4))  # keeps changing parameters while the save may still run
    manager.wait()
    assert manager.latest() == 2
    restored = _fresh_state(seed=5)
    manager.load(2, restored)
    for name, value in full_parameters(restored.model).items():
        assert torch.equal(value, snapshot[name]), name


def test_missing_and_corrupted_checkpoints_give_clear_errors(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(FileNotFoundError, match="latest"):
        manager.load("latest", _fresh_state())
    manager.save(1, _fresh_state())
    with pytest.raises(
        FileNotFoundError, match=r"step-000009 does not exist \(complete steps: 1\)"
    ):
        manager.load(9, _fresh_state())

    step_dir = tmp_path / "step-000001"
    state_json = step_dir / "train_state.json"
    good = state_json.read_text()
    state_json.write_text("{not json")
    with pytest.raises(ValueError, match=r"train_state\.json is corrupted"):
        manager.load(1, _fresh_state())
    state_json.write_text(good)

    (step_dir / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(ValueError, match="not a DCP metadata type"):
        manager.load(1, _fresh_state())
    (step_dir / ".metadata").unlink()
    with pytest.raises(FileNotFoundError, match="not a complete DCP checkpoint"):
        manager.load(1, _fresh_state())


def test_wrong_model_shape_names_the_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _fresh_state())
    other = TrainState(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    with pytest.raises(RuntimeError, match="step-000001 could not be loaded"):
        manager.load(1, other)


_SIGTERM_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from training.checkpoint import CheckpointManager, LastGasp
    from tests.services.trainer.test_checkpoint import _fresh_state, _train

    state = _fresh_state()
    manager = CheckpointManager(sys.argv[1])
    gasp = LastGasp().install()
    for step in range(1, 10_000):
        _train(state, range(step - 1, step))
        print(f"step {step}", flush=True)
        if gasp.agreed():
            manager.save(step, state)
            print(f"saved {step}", flush=True)
            sys.exit(0)
        time.sleep(0.05)
    sys.exit(3)
    """
)


def test_sigterm_triggers_a_last_gasp_save(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MESHLINE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("step 1")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    saved = int(out.strip().splitlines()[-1].split()[1])
    assert CheckpointManager(tmp_path).latest() == saved
    assert CheckpointManager(tmp_path).load("latest", _fresh_state()) == saved


def test_last_gasp_flag_without_a_signal_stays_clear():
    gasp = LastGasp().install()
    try:
        assert not gasp.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not gasp.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gasp.agreed() and gasp.received == signal.SIGTERM
    finally:
        gasp.uninstall()


def _vote_body(rank: int, world_size: int, signals: list[int | None]) -> tuple[bool, bool]:
    gasp = LastGasp().install()
    try:
        if signals[rank] is not None:
            os.kill(os.getpid(), signals[rank])
            deadline = time.monotonic() + 5
            while not gasp.requested and time.monotonic() < deadline:
                time.sleep(0.01)
        return gasp.agreed(), gasp.save_agreed
    finally:
        gasp.uninstall()


@pytest.mark.dist
@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        ([signal.SIGUSR2, None], (True, False)),  # stop without saving, seen by every rank
        ([signal.SIGUSR2, signal.SIGTERM], (True, True)),  # a save request wins
        ([None, None], (False, True)),
    ],
)
def test_ranks_agree_on_stop_and_on_saving(signals, expected):
    assert run_distributed(_vote_body, 2, signals) == [expected, expected]
