"""LoRA under data parallelism (2 real gloo ranks): ZeRO 0/1/3 give the 1-process losses, the
base stays frozen, and a ZeRO-3 save writes adapters that resume on one process."""

from __future__ import annotations

import pytest
import torch

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from training.loop import Trainer

FLAGS = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--eval-interval", "0", "--lr", "1e-2", "--train-iters", "3",
         "--lora-target-modules", "query_key_value", "dense_4h_to_h", "--lora-r", "4"]  # fmt: skip
LAYOUTS = {
    "zero0": ["--zero-stage", "0"],
    "zero1": ["--use-distributed-optimizer"],
    "zero3": ["--zero-stage", "3"],
}


def _run(flags: list[str]) -> tuple[list[float], bool]:
    trainer = Trainer(parse_args(flags))
    frozen = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n
    }
    losses = [trainer.train_step().loss for _ in range(3)]
    unchanged = all(
        torch.equal(p.detach(), frozen[n])
        for n, p in trainer.model.named_parameters()
        if ".lora_" not in n
    )
    if "--save" in flags:
        trainer.save()
    return losses, unchanged


def _all_layouts(rank: int, world_size: int, save_dir: str) -> dict[str, tuple[list[float], bool]]:
    out = {name: _run([*FLAGS, *extra]) for name, extra in LAYOUTS.items()}
    out["zero3-save"] = _run([*FLAGS, "--zero-stage", "3", "--save", save_dir])
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_lora_dp2_matches_single_process(tmp_path):
    reference, _ = _run(FLAGS)
    results = run_distributed(_all_layouts, 2, str(tmp_path / "zero3"))
    for name, (losses, unchanged) in results[0].items():
        assert unchanged, name  # the base weights never move
        assert losses == pytest.approx(reference, rel=1e-6), name
    # The ZeRO-3 adapters (saved from sharded DTensors) export to peft and resume on 1 process.
    assert (tmp_path / "zero3" / "adapter" / "adapter_model.safetensors").is_file()
    resumed = Trainer(parse_args([*FLAGS, "--lora-load", str(tmp_path / "zero3" / "adapter")]))
    assert any(p.abs().sum() > 0 for n, p in resumed.model.named_parameters() if "lora_B" in n)
