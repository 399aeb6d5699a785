"""ZeRO-3 parameters on the NVMe tier (--param-nvme-path, parallel/param_swap.py): the same losses
as the un-offloaded ZeRO-3 run, exact resume from a checkpoint written while the shards live in
the swap file, and a peak resident set lower by the parameter bytes moved off."""

from __future__ import annotations

import os

import pytest

from tests.parallel.parity import BASE

STEPS = 20
SAVE_AT = 10
PARAM_NVME = ["--zero-stage", "3", "--cpu-offload", "--optimizer-cpu-offload"]


def test_flags_refused_by_name(tmp_path):
    """--param-nvme-path names what it needs: ZeRO-3's host shards and the CPU optimizer step,
    and data parallelism alone."""
    from models.model_states import PARAM_SWAP_BUFFER_COUNT
    from services.trainer.arguments import parse_args

    swap = ["--param-nvme-path", str(tmp_path / "params")]
    with pytest.raises(ValueError, match=r"--param-nvme-path.*--cpu-offload"):
        parse_args([*BASE, "--zero-stage", "3", "--optimizer-cpu-offload", *swap])
    with pytest.raises(ValueError, match=r"--param-nvme-path.*--optimizer-cpu-offload"):
        parse_args([*BASE, "--zero-stage", "3", "--cpu-offload", *swap])
    with pytest.raises(ValueError, match="--param-nvme-path offloads ZeRO-3's data-parallel"):
        parse_args([*BASE, *PARAM_NVME, *swap, "--tensor-model-parallel-size", "2"])
    with pytest.raises(ValueError, match="--param-nvme-buffer-count 3: give 1 or more, with"):
        parse_args([*BASE, *PARAM_NVME, "--param-nvme-buffer-count", "3"])
    with pytest.raises(ValueError, match="--param-nvme-buffer-count 0"):
        parse_args([*BASE, *PARAM_NVME, *swap, "--param-nvme-buffer-count", "0"])
    parse_args([*BASE, *PARAM_NVME, *swap, "--param-nvme-buffer-count", "2"]).validate(2)
    # The flag's default is the library's (the torch-free config section spells it out).
    assert parse_args(BASE).parallel.param_nvme_buffer_count == PARAM_SWAP_BUFFER_COUNT


def test_path_confined_to_the_data_roots(tmp_path, monkeypatch):
    """The swap directory is a path like any other: outside the data roots it is refused with the
    flag named, before any worker starts."""
    from services.trainer.arguments import parse_args

    monkeypatch.setenv("MESHLINE_DATA_ROOTS", str(tmp_path / "root"))
    (tmp_path / "root").mkdir()
    outside = tmp_path / "elsewhere"
    config = parse_args([*BASE, *PARAM_NVME, "--param-nvme-path", str(outside)])
    with pytest.raises(ValueError, match="--param-nvme-path"):
        config.validate(2)


def _runs(rank: int, world_size: int, root: str) -> dict:
    """20 steps of ZeRO-3 without offload, and with the parameters on the NVMe tier (optimizer on
    the CPU, then in swap files too); the second saves at SAVE_AT and a fresh run resumes."""
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    base = [*BASE, "--train-iters", str(STEPS)]
    param = [*PARAM_NVME, "--param-nvme-path", f"{root}/params"]
    runs = {
        "zero3": ["--zero-stage", "3"],
        "params nvme, optimizer cpu": param,
        "params nvme, optimizer nvme": [*param, "--optimizer-nvme-path", f"{root}/optim"],
    }
    out: dict = {}
    for name, flags in runs.items():
        save = ["--save", f"{root}/ckpt"] if name.endswith("optimizer nvme") else []
        trainer = Trainer(parse_args([*base, *flags, *save]))
        losses = []
        for step in range(STEPS):
            losses.append(trainer.train_step().loss)
            if save and step == SAVE_AT - 1:
                trainer.save()
                trainer.checkpoints.wait()
        out[name] = losses
        if trainer.param_swap is not None:
            out[f"{name}: gathers"] = (
                trainer.param_swap.gathers,
                trainer.param_swap.read_ahead_hits,
            )
    flags = [*runs["params nvme, optimizer nvme"], "--load", f"{root}/ckpt"]
    resumed = Trainer(parse_args([*base, *flags]))
    resumed.load()
    out["resumed"] = [resumed.train_step().loss for _ in range(STEPS - SAVE_AT)]
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_losses_equal_and_resume_exact(tmp_path):
    """DP2 gloo: with the parameters on the NVMe tier the 20 losses equal un-offloaded ZeRO-3's
    within 1e-6; a checkpoint written from the tier resumes into the same last 10 losses, bit for
    bit; the reads run ahead of the gathers after the first step; no swap file is left behind."""
    from tests.harness import run_distributed

    results = run_distributed(_runs, 2, str(tmp_path))
    for out in results:
        reference = out["zero3"]
        for name in ("params nvme, optimizer cpu", "params nvme, optimizer nvme"):
            diff = max(abs(a - b) for a, b in zip(out[name], reference, strict=True))
            assert diff < 1e-6, (name, diff)
            gathers, ahead = out[f"{name}: gathers"]
            # The first step records the order; every later one reads each group ahead of its
            # gather but the step's first.
            assert ahead == (STEPS - 1) * (gathers // STEPS - 1), (gathers, ahead)
        assert out["resumed"] == out["params nvme, optimizer nvme"][SAVE_AT:]
    assert os.listdir(tmp_path / "params") == []  # the swap files are unlinked at creation


PEAK_HIDDEN, PEAK_LAYERS, PEAK_VOCAB = 256, 24, 1024


def _peak(rank: int, world_size: int, flags: list[str]) -> dict:
    """Peak resident set of 3 ZeRO-3 steps of a 24M-parameter model, and the tier's bytes."""
    from torch.distributed.tensor import DTensor

    from bench.bench_zero import status_bytes
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    shape = ["--num-layers", str(PEAK_LAYERS), "--hidden-size", str(PEAK_HIDDEN),
             "--ffn-hidden-size", str(4 * PEAK_HIDDEN), "--num-attention-heads", "8",
             "--num-query-groups", "4", "--vocab-size", str(PEAK_VOCAB)]  # fmt: skip
    trainer = Trainer(parse_args([*BASE, *shape, "--train-iters", "3", *flags]))
    for _ in range(3):
        trainer.train_step()
    shard = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.model.parameters()
    )
    swap = trainer.param_swap
    return {
        "peak": status_bytes("VmHWM"),
        "shard_bytes": 4 * shard,
        "buffer_bytes": swap.buffer_bytes() if swap is not None else 0,
    }


@pytest.mark.dist
@pytest.mark.slow
def test_peak_rss_falls_by_the_parameter_bytes(tmp_path, monkeypatch):
    """Same model, same optimizer tier (NVMe): moving the parameter shards into the swap file
    lowers each rank's peak resident set by about the shard bytes less the tier's two buffers
    (fresh processes; glibc's mmap threshold fixed, as bench_ladder, so freed memory leaves)."""
    from tests.harness import run_distributed

    # Read by glibc when a process starts: set here, inherited by the spawned ranks.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    optim = [*PARAM_NVME, "--optimizer-nvme-path", str(tmp_path / "optim")]
    kept = run_distributed(_peak, 2, optim)
    moved = run_distributed(_peak, 2, [*optim, "--param-nvme-path", str(tmp_path / "p")])
    for before, after in zip(kept, moved, strict=True):
        expected = after["shard_bytes"] - after["buffer_bytes"]
        drop = before["peak"] - after["peak"]
        print("PEAK", before, after, drop, expected)
        assert expected > 20 * 2**20  # the model is big enough for the margin below to mean much
        assert 0.6 * expected <= drop <= 1.4 * after["shard_bytes"], (drop, expected)
