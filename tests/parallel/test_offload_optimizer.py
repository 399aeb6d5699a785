"""The offloaded optimizer (--optimizer-cpu-offload, --optimizer-nvme-path): the same AdamW update
as torch's, under every ZeRO stage, with exact resume from the NVMe tier.

Unit tests step `parallel.offload_optimizer.OffloadAdamW` against `torch.optim.AdamW` (fused:
bit for bit; foreach: within 1e-6) with chunks smaller than a parameter, so the read-ahead /
write-behind pipeline crosses parameter boundaries; the host-memory test checks that the NVMe
tier keeps its states out of anonymous memory. The dist test trains the tiny Llama 20 steps on
2 gloo ranks per ZeRO stage with and without offload (losses within 1e-6) and resumes a run
saved from the NVMe tier at step 10 (the last 10 losses bit-identical).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from checkpoints.safe_fs import open_dir_beneath
from parallel.offload_optimizer import OffloadAdamW, OptimizerOffload
from training.optimizer import open_nvme_path

HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _train(make, steps: int = 20) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False)
    )
    optimizer = make(model.parameters())
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 32, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model, optimizer


def _nvme(path: Path, **kw) -> OptimizerOffload:
    return OptimizerOffload("nvme", nvme_path=str(path), **kw)


def _adamw(params, tier: OptimizerOffload) -> OffloadAdamW:
    swap_dir = None
    if tier.nvme_path is not None:
        swap_dir = open_dir_beneath(tier.nvme_path, roots=(), create=True)
    return OffloadAdamW(params, offload=tier, swap_dir=swap_dir, **HYPER)


@pytest.mark.parametrize("buffers", [2, 3])
def test_offloaded_adamw_is_torch_adamw(tmp_path, buffers):
    """cpu and nvme tiers (chunks of 1000 elements across 3072-element weights) give torch's
    fused AdamW's parameters and states exactly, and foreach AdamW's losses within 1e-6."""
    fused_losses, fused_model, fused = _train(lambda p: torch.optim.AdamW(p, fused=True, **HYPER))
    foreach_losses, _, _ = _train(lambda p: torch.optim.AdamW(p, foreach=True, **HYPER))
    tiers = {
        "cpu": OptimizerOffload("cpu"),
        "nvme": _nvme(tmp_path, buffer_numel=1000, buffer_count=buffers),
    }
    for name, tier in tiers.items():
        losses, model, optimizer = _train(lambda p, tier=tier: _adamw(p, tier))
        assert losses == fused_losses, name
        assert max(abs(a - b) for a, b in zip(losses, foreach_losses, strict=True)) < 1e-6
        for ours, theirs in zip(model.parameters(), fused_model.parameters(), strict=True):
            assert torch.equal(ours, theirs), name
        mine, ref = optimizer.state_dict()["state"], fused.state_dict()["state"]
        for index in ref:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(mine[index][key], ref[index][key]), (name, index, key)


def test_nvme_state_dict_round_trip_resumes_exactly(tmp_path):
    """A state_dict taken from the nvme tier, loaded into a fresh nvme optimizer (and into torch's
    AdamW), continues exactly as the uninterrupted run."""
    full, _, _ = _train(lambda p: _adamw(p, _nvme(tmp_path / "a")), 12)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False)
    )
    first = _adamw(model.parameters(), _nvme(tmp_path / "b", buffer_numel=700))
    generator = torch.Generator().manual_seed(1)
    losses = []

    def step(optimizer):
        loss = model(torch.randn(8, 32, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    for _ in range(6):
        step(first)
    saved = {k: v for k, v in first.state_dict().items()}
    saved["state"] = {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()}
    first.close()
    second = _adamw(model.parameters(), _nvme(tmp_path / "c"))
    second.load_state_dict(saved)
    for _ in range(6):
        step(second)
    assert losses == full


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _grown_by_step(tier_name: str, path: str) -> int:
    """Anonymous memory one optimizer step of a 16M-element parameter adds (in this process)."""
    numel = 1 << 24
    tier = (
        OptimizerOffload("cpu")
        if tier_name == "cpu"
        else _nvme(Path(path), buffer_numel=1 << 18, buffer_count=4)
    )
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full((numel,), 1e-3)
    optimizer = _adamw([param], tier)
    before = _rss_anon()
    optimizer.step()
    grown = _rss_anon() - before
    assert optimizer.state_bytes_in_memory() == (8 * numel if tier_name == "cpu" else 0)
    assert optimizer.buffer_bytes() == (0 if tier_name == "cpu" else 4 * 2 * 4 * (1 << 18))
    optimizer.close()
    return grown


def test_nvme_tier_keeps_states_out_of_memory(tmp_path):
    """Stepping a 16M-element parameter: the cpu tier's m and v take 128 MiB of anonymous memory,
    the nvme tier's at most its 4 x 2 x 1 MiB buffers (plus allocator noise). Each tier is
    measured in a fresh process: in a long test process the allocator may reuse memory freed by
    earlier tests (or run with a raised mmap threshold another test set), hiding new pages."""
    import json
    import subprocess
    import sys

    grown = {}
    for name in ("cpu", "nvme"):
        code = (
            "import json, sys; from tests.parallel.test_offload_optimizer import _grown_by_step; "
            f"print(json.dumps(_grown_by_step({name!r}, sys.argv[1])))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=Path(__file__).resolve().parents[2],
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        grown[name] = json.loads(done.stdout.strip().splitlines()[-1])
    assert grown["cpu"] > 120 * 2**20, grown
    assert grown["nvme"] < 24 * 2**20, grown


def test_nvme_path_symlink_escape_refused(tmp_path, monkeypatch):
    """--optimizer-nvme-path is confined like every path: outside the roots, or through a
    symlink, refused naming the flag."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    monkeypatch.setenv("MESHLINE_DATA_ROOTS", str(root))
    open_nvme_path(str(root / "swap"), "--optimizer-nvme-path").close()
    assert (root / "swap").is_dir()
    for bad in (root / "link" / "swap", outside / "swap"):
        with pytest.raises(ValueError, match="--optimizer-nvme-path"):
            open_nvme_path(str(bad), "--optimizer-nvme-path")
    assert not (outside / "swap").exists()


def test_flags_refused_by_name():
    """The offload flags name what they need."""
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE

    with pytest.raises(ValueError, match="--optimizer-cpu-offload"):
        parse_args([*BASE, "--optimizer-nvme-path", "/tmp/x"])
    with pytest.raises(ValueError, match="--optimizer cadam"):
        parse_args([*BASE, "--optimizer", "cadam", "--optimizer-cpu-offload"]).validate()
    with pytest.raises(ValueError, match="--offload-pin-memory"):
        parse_args([*BASE, "--offload-pin-memory"])


STEPS = 20
SAVE_AT = 10


def _offload_runs(rank: int, world_size: int, swap: str, save: str) -> dict:
    """Each ZeRO stage without and with optimizer offload (cpu, nvme) on 2 ranks; the ZeRO-2
    NVMe run saves at step SAVE_AT and a fresh NVMe run resumes from there."""
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE
    from training.loop import Trainer

    base = [*BASE, "--train-iters", str(STEPS)]
    out: dict = {}
    for stage in ("1", "2", "3"):
        tiers = {
            "none": [],
            "cpu": ["--optimizer-cpu-offload"],
            "nvme": ["--optimizer-cpu-offload", "--optimizer-nvme-path", f"{swap}/{stage}"],
        }
        if stage == "3":
            tiers["param+nvme"] = ["--cpu-offload", *tiers["nvme"]]
        for tier, flags in tiers.items():
            extra = ["--save", save] if (stage, tier) == ("2", "nvme") else []
            trainer = Trainer(parse_args([*base, "--zero-stage", stage, *flags, *extra]))
            losses = []
            for step in range(STEPS):
                losses.append(trainer.train_step().loss)
                if extra and step == SAVE_AT - 1:
                    trainer.save()
                    trainer.checkpoints.wait()
            out[(stage, tier)] = losses
    nvme = ["--optimizer-cpu-offload", "--optimizer-nvme-path", f"{swap}/resume"]
    resumed = Trainer(parse_args([*base, "--zero-stage", "2", *nvme, "--load", save]))
    resumed.load()
    out["resumed"] = [resumed.train_step().loss for _ in range(STEPS - SAVE_AT)]
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_offload_losses_and_nvme_resume(tmp_path):
    """20 steps of every ZeRO stage with optimizer offload (cpu and nvme; ZeRO-3 also with
    parameter offload) equal the un-offloaded run within 1e-6; the NVMe run's checkpoint at step
    10 resumes into the same last 10 losses."""
    from tests.harness import run_distributed

    results = run_distributed(_offload_runs, 2, str(tmp_path / "swap"), str(tmp_path / "ckpt"))
    for out in results:
        for key, losses in out.items():
            if key == "resumed":
                continue
            stage, _ = key
            reference = out[(stage, "none")]
            assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-6, key
        assert out["resumed"] == out[("2", "nvme")][SAVE_AT:]
    assert os.listdir(tmp_path / "swap" / "2") == []  # swap files are unlinked at creation


def test_pin_memory_has_nothing_to_pin_on_a_cpu_run(tmp_path):
    """--offload-pin-memory on a CPU run: fp32 host parameters are stepped in place, no staging
    buffer exists to pin, and the update is the unpinned one (docs/decisions.md)."""
    plain, _, _ = _train(lambda p: _adamw(p, OptimizerOffload("cpu")))
    pinned, _, optimizer = _train(lambda p: _adamw(p, OptimizerOffload("cpu", pin_memory=True)))
    assert pinned == plain
    assert optimizer.buffer_bytes() == 0
