"""Issue #18 MoE families end to end: Qwen2-MoE (routed experts + gated shared expert, qkv bias)
and Qwen3-MoE (q/k norm, explicit head_dim) train with expert parallelism EP2 on 2 gloo
processes, the checkpoint converts to HF (verified by default), transformers' own class loads the
export, and Meshline's serving loader (`--load-format hf`) gives transformers' logits on it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints.native_format import NativeSource
from engine.loading import load_checkpoint
from services.converter.job import ConvertOptions, convert
from services.converter.verify import load_model
from tests.harness import run_distributed

STEPS = 3
FLAGS = ["--num-layers", "2", "--mock-data", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-interval", "0",
         "--lr", "1e-2", "--log-interval", "1000", "--train-iters", str(STEPS),
         "--expert-model-parallel-size", "2"]  # fmt: skip


def _train_ep2(rank, world_size, model, save):
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    trainer = Trainer(parse_args(["--model", model, *FLAGS, "--save", save]))
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    trainer.save()
    trainer.checkpoints.wait()
    return losses


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "model,model_type,hf_class",
    [
        ("tiny-qwen2-moe", "qwen2_moe", "Qwen2MoeForCausalLM"),
        ("tiny-qwen3-moe", "qwen3_moe", "Qwen3MoeForCausalLM"),
    ],
)
def test_moe_family_trains_ep2_converts_serves_and_matches_transformers(
    model, model_type, hf_class, tmp_path
):
    save = tmp_path / "run"
    losses = run_distributed(_train_ep2, 2, model, str(save))
    assert losses[0] == losses[1]  # both ranks log the global loss
    assert losses[0][-1] < losses[0][0]
    report = convert(ConvertOptions("native", "hf", save, tmp_path / "hf"))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0.0
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == model_type
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(hf).__name__ == hf_class
    served = load_checkpoint(tmp_path / "hf", load_format="hf")
    trained = load_model(NativeSource(save))
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (served.model(ids) - expected).abs().max().item() <= 5e-5
        assert torch.equal(served.model(ids), trained(ids))
