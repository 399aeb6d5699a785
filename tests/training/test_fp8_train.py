"""--fp8 tensorwise|rowwise through the trainer: the decoder linears are FP8 linears, the loss
curve stays near bf16's, checkpoints hold ordinary weights that `meshline convert` exports, and
the combinations FP8 does not support are refused naming the flags.

Tolerances: on CPU a 40-step run of the tiny Llama (loss 5.57 -> ~3.05) stays within 0.02 of
bf16 in the mean of its last 5 losses and within 0.05 at every step (measured: 0.004 and 0.023).
The issue's target, within 0.01 at step 200, is a GPU figure (the gpu-marked test below and
`make device-check`'s FP8 phase on the 1.24B model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.fp8_linear import E4M3, E5M2, Fp8Linear, rowwise_supported
from services.trainer.arguments import parse_args
from training.loop import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--model", "tiny-llama", "--mock-data", "--seq-length", "64", "--micro-batch-size", "4",
    "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-style", "constant",
    "--eval-interval", "0", "--bf16", "--seed", "1",
]  # fmt: skip


def _losses(flags: list[str], steps: int) -> tuple[Trainer, list[float]]:
    torch.manual_seed(0)
    trainer = Trainer(parse_args([*flags, "--train-iters", str(steps)]))
    return trainer, [trainer.train_step().loss for _ in range(steps)]


def _fp8_layers(model: torch.nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


ROWWISE_ON_CPU = pytest.mark.skipif(
    not rowwise_supported("cpu"),
    reason=f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only",
)


@pytest.mark.parametrize(
    ("recipe", "grad_dtype"),
    [("tensorwise", E5M2), pytest.param("rowwise", E4M3, marks=ROWWISE_ON_CPU)],
)
def test_fp8_training_follows_the_bf16_loss_curve(recipe, grad_dtype):
    steps = 40
    _, bf16 = _losses(TINY, steps)
    trainer, fp8 = _losses([*TINY, "--fp8", recipe], steps)
    layers = _fp8_layers(trainer.model)
    # every decoder linear (attention qkv/o, MLP gate_up/down of 2 layers); not the head
    assert len(layers) == 8 and all(n.startswith("layers.") for n in layers)
    assert all(m.granularity == recipe and m.grad_dtype == grad_dtype for m in layers.values())
    assert bf16[-1] < bf16[0] - 2 and fp8[-1] < fp8[0] - 2  # both learn
    assert max(abs(a - b) for a, b in zip(bf16, fp8, strict=True)) < 0.05
    assert abs(sum(fp8[-5:]) / 5 - sum(bf16[-5:]) / 5) < 0.02
    # masters and optimizer state stay fp32, the model's weights bf16
    optimizer = trainer.optimizer
    assert optimizer.plan.mode == "master"
    assert all(m.dtype == torch.float32 for m in optimizer.master_params)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())


def test_megatron_fp8_format_runs_the_same_training_as_fp8_tensorwise():
    _, ours = _losses([*TINY, "--fp8", "tensorwise"], 3)
    _, megatron = _losses([*TINY, "--fp8-format", "hybrid", "--fp8-amax-history-len", "1"], 3)
    assert ours == megatron
    trainer, _ = _losses([*TINY, "--fp8-format", "e4m3"], 1)
    assert {m.grad_dtype for m in _fp8_layers(trainer.model).values()} == {E4M3}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fp8", "tensorwise"], r"--fp8 tensorwise needs --bf16"),
        (["--fp8", "rowwise", "--fp16"], r"--fp8 rowwise needs --bf16.*--fp16"),
        (["--bf16", "--fp8", "rowwise", "--fp8-grad-format", "e5m2"], r"--fp8-grad-format e5m2"),
        (["--bf16", "--fp8-grad-format", "e4m3"], r"--fp8-grad-format e4m3 needs --fp8"),
        (["--bf16", "--fp8", "tensorwise", "--qat", "int8"], r"--fp8 tensorwise and --qat int8"),
        (["--bf16", "--fp8", "tensorwise", "--peft-method", "lora", "--lora-target-modules",
          "dense"], r"--fp8 tensorwise.*--peft-method lora"),
        (["--bf16", "--fp8-amax-compute-algo", "max"], r"--fp8-amax-compute-algo .*add --fp8"),
        (["--bf16", "--fp8", "tensorwise", "--fp8-amax-history-len", "1024"],
         r"--fp8-amax-history-len 1024 is not supported"),
        (["--bf16", "--fp8-recipe", "delayed"], r"--fp8-recipe delayed .*--fp8 tensorwise"),
        (["--bf16", "--fp8-recipe", "mxfp8"], r"--fp8-recipe mxfp8 .*--fp8 rowwise"),
        (["--bf16", "--fp8", "rowwise", "--fp8-format", "hybrid"], r"--fp8-format hybrid"),
        (["--bf16", "--fp8", "tensorwise", "--fp8-param-gather"], r"--fp8-param-gather"),
    ],
)  # fmt: skip
def test_unsupported_fp8_settings_are_refused_naming_the_flag(extra, message):
    base = [a for a in TINY if a != "--bf16"]
    with pytest.raises(ValueError, match=message):
        parse_args([*base, *extra]).validate()


@pytest.mark.parametrize(
    ("layout", "world", "named"),
    [
        (["--tensor-model-parallel-size", "2"], 2, "--tensor-model-parallel-size"),
        (["--pipeline-model-parallel-size", "2"], 2, "--pipeline-model-parallel-size"),
    ],
)
def test_sharded_or_staged_linears_are_refused_before_any_worker(layout, world, named):
    config = parse_args([*TINY, "--fp8", "rowwise", *layout])
    with pytest.raises(ValueError, match=f"--fp8 rowwise .*{named}"):
        config.validate(world)


def test_a_decoder_linear_fp8_cannot_take_is_named():
    flags = [*TINY, "--fp8", "tensorwise", "--ffn-hidden-size", "40", "--train-iters", "1"]
    with pytest.raises(
        ValueError, match=r"--fp8 tensorwise: layers\.0\.mlp\.down_proj has in_features 40"
    ):
        Trainer(parse_args(flags))


@pytest.mark.slow  # the converter's process (~30 s on the busy 2-core box)
def test_an_fp8_checkpoint_converts_like_any_other(tmp_path):
    """The saved weights are the fp32 masters under their usual names: `meshline convert`
    writes an HF model whose logits equal the trained model's (run in bf16 both sides)."""
    from transformers import AutoModelForCausalLM

    save, out = tmp_path / "run", tmp_path / "hf"
    trainer = Trainer(parse_args([*TINY, "--fp8", "tensorwise", "--train-iters", "3",
                                  "--save", str(save)]))  # fmt: skip
    trainer.fit()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "convert", "--load-format", "native",
         "--save-format", "hf", "--load-dir", str(save), "--save-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    optimizer = trainer.optimizer
    masters = dict(zip(map(id, optimizer.model_params), optimizer.master_params, strict=True))
    named = dict(trainer.model.named_parameters())
    down = hf.model.layers[0].mlp.down_proj.weight
    assert torch.equal(down, masters[id(named["layers.0.mlp.down_proj.weight"])])
    # an ordinary (non-FP8) model from the same masters computes what transformers computes
    ids = torch.tensor([[1, 4, 5, 6, 14, 7]])
    reference = Trainer(parse_args([*TINY, "--train-iters", "1"])).model.float().eval()
    reference.load_state_dict({n: masters[id(p)] for n, p in named.items()}, strict=True)
    with torch.no_grad():
        assert (hf(ids).logits - reference(ids).float()).abs().max() < 1e-4


@pytest.mark.slow  # inductor compiles the FP8 layers on CPU (~100 s on the busy 2-core box)
def test_fp8_with_compile_matches_eager_without_graph_breaks():
    from torch._dynamo.utils import counters

    counters.clear()
    _, eager = _losses([*TINY, "--fp8", "tensorwise"], 2)
    _, compiled = _losses([*TINY, "--fp8", "tensorwise", "--compile"], 2)
    assert sum(counters["graph_break"].values()) == 0
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_fp8_loss_within_0_01_of_bf16_at_step_200(recipe):
    """The issue's criterion on a small GPU model (the 1.24B figure is the device check's):
    the mean loss of steps 191-200 with --fp8 within 0.01 of bf16's."""
    flags = [
        "--model", "tiny-llama", "--num-layers", "4", "--hidden-size", "512",
        "--num-attention-heads", "8", "--ffn-hidden-size", "1408", "--vocab-size", "4096",
        "--max-position-embeddings", "512", "--seq-length", "512", "--micro-batch-size", "8",
        "--global-batch-size", "8", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--eval-interval", "0", "--bf16", "--seed", "1",
    ]  # fmt: skip
    steps = 200
    _, bf16 = _losses(flags, steps)
    _, fp8 = _losses([*flags, "--fp8", recipe], steps)
    assert bf16[-1] < bf16[0] - 1
    assert abs(sum(fp8[-10:]) / 10 - sum(bf16[-10:]) / 10) <= 0.01


def test_rowwise_is_refused_where_the_cpu_kernel_takes_tensor_scales_only(monkeypatch):
    """torch 2.11's CPU _scaled_mm has no row-wise scales: --fp8 rowwise is refused by name
    before training instead of failing inside the first matmul."""
    import training.fp8

    monkeypatch.setattr(training.fp8, "rowwise_supported", lambda device_type: False)
    with pytest.raises(ValueError, match=r"--fp8 rowwise: .* per-tensor scales only"):
        Trainer(parse_args([*TINY, "--fp8", "rowwise", "--train-iters", "1"]))
