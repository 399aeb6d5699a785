"""LoRA under pipeline and context parallelism (2 real gloo ranks): the loss curve and the
adapters equal the 1-process run (same tolerances as the trainer's parity tests: losses 1e-5,
parameters 1e-4 relative per tensor)."""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.parallel.parity import max_loss_diff, max_param_diff, run_layout

STEPS = 6
LORA = ["--lora-target-modules", "query_key_value", "dense", "dense_4h_to_h", "--lora-r", "4",
        "--lora-alpha", "8"]  # fmt: skip
LAYOUTS = {
    "pp2-1f1b": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_one_process(layout):
    ref = run_distributed(run_layout, 1, LORA, STEPS)[0]
    results = run_distributed(run_layout, 2, [*LORA, *LAYOUTS[layout]], STEPS)
    for got in results:
        assert max_loss_diff(ref["losses"], got["losses"]) <= 1e-5, (ref["losses"], got["losses"])
        assert max_param_diff(ref["params"], got["params"]) <= 1e-4
    # The adapters trained (B starts at zero).
    assert all(t.abs().sum() > 0 for n, t in ref["params"].items() if "lora_B" in n)


def _save_body(rank: int, world_size: int, save_dir: str) -> None:
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE
    from training.loop import Trainer

    flags = [*BASE, "--train-iters", "2", *LORA, "--pipeline-model-parallel-size", "2"]
    trainer = Trainer(parse_args([*flags, "--save", save_dir]))
    trainer.train_step()
    trainer.save()


@pytest.mark.dist
@pytest.mark.slow
def test_pp2_export_holds_every_stage_adapters(tmp_path):
    """Each pipeline rank holds half the layers; the exported adapter has all of them."""
    from safetensors.torch import load_file

    run_distributed(_save_body, 2, str(tmp_path))
    state = load_file(str(tmp_path / "adapter" / "meshline_adapter.safetensors"))
    layers = {int(k.split(".")[1]) for k in state}
    assert layers == {0, 1, 2, 3}
    assert len(state) == 4 * 3 * 2  # 4 layers x (qkv, o, down) x (A, B)
