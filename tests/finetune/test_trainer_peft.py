"""Parameter-efficient fine-tuning through the trainer: frozen base, adapter-only checkpoints,
resume, peft export, BitFit and prefix tuning, and flag validation."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

from models.hf_adapters import to_hf
from services.trainer.arguments import parse_args
from training.loop import Trainer

BASE = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
        "--eval-interval", "0", "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "4"]  # fmt: skip
LORA = ["--lora-target-modules", "query_key_value", "dense", "dense_4h_to_h", "--lora-r", "4",
        "--lora-alpha", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    """A full checkpoint of a briefly trained tiny Llama (the model to fine-tune)."""
    path = tmp_path_factory.mktemp("base")
    trainer = Trainer(parse_args([*BASE, "--save", str(path)]))
    trainer.train_step()
    trainer.save()
    return path, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _lora(base, *extra):
    return Trainer(parse_args([*BASE, *LORA, "--load", str(base), "--finetune", *extra]))


def test_lora_trains_adapters_only_and_resumes(base_ckpt, tmp_path):
    base, base_params = base_ckpt
    straight = _lora(base)
    straight.load()
    for name, p in straight.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base_params[name]), name  # base loaded
    for _ in range(4):
        straight.train_step()
    for name, p in straight.model.named_parameters():
        if ".lora_" not in name:
            assert not p.requires_grad and torch.equal(p, base_params[name]), name  # frozen

    first = _lora(base, "--save", str(tmp_path / "run"))
    first.load()
    first.train_step(), first.train_step()
    step_dir = first.save()
    saved = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["down_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    # The step checkpoint holds the adapters only: far smaller than the base's.
    size = sum(f.stat().st_size for f in (tmp_path / "run").rglob("*.distcp"))
    base_size = sum(f.stat().st_size for f in base.rglob("*.distcp"))
    assert 0 < size < base_size / 5, (size, base_size, step_dir)

    resumed = _lora(base, "--lora-load", str(tmp_path / "run"))
    assert resumed.load() == 2 and resumed.state.step == 2 and resumed.scheduler.num_steps == 2
    resumed.train_step(), resumed.train_step()
    expected = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_lora_run_saved_without_optimizer_state_resumes_with_no_load_optim(base_ckpt, tmp_path):
    base, _ = base_ckpt
    first = _lora(base, "--save", str(tmp_path / "run"), "--no-save-optim", "--no-save-rng")
    first.load()
    first.train_step()
    first.save()
    with pytest.raises(ValueError, match="pass --no-load-optim"):
        _lora(base, "--lora-load", str(tmp_path / "run")).load()
    resumed = _lora(base, "--lora-load", str(tmp_path / "run"), "--no-load-optim", "--no-load-rng")
    assert resumed.load() == 1
    lora = {n: p for n, p in resumed.model.named_parameters() if ".lora_" in n}
    assert all(torch.equal(p, dict(first.model.named_parameters())[n]) for n, p in lora.items())


def test_lora_bf16_keeps_fp32_masters_across_resume(base_ckpt, tmp_path):
    """--bf16 (ZeRO 0): the adapters' fp32 master copies and their Adam state are what the
    checkpoint holds, so a resume continues the uninterrupted run exactly."""
    base, _ = base_ckpt
    straight = _lora(base, "--bf16")
    straight.load()
    first = _lora(base, "--bf16", "--save", str(tmp_path / "run"))
    first.load()
    for trainer in (straight, straight, first, first):
        trainer.train_step()
    first.save()
    straight.train_step(), straight.train_step()

    resumed = _lora(base, "--bf16", "--lora-load", str(tmp_path / "run"))
    assert resumed.load() == 2
    resumed.train_step(), resumed.train_step()
    expected = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, expected[name]), name
    masters = straight.optimizer.master_params
    assert len(masters) == len(resumed.optimizer.master_params) > 0
    for want, got in zip(masters, resumed.optimizer.master_params, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_exported_adapter_loads_in_peft_and_meshline(base_ckpt, tmp_path):
    """The <save>/adapter directory gives the trained logits through peft on the HF model, and
    `--lora-load <adapter>` restores the same adapters into a new run."""
    from tests.models.test_hf_parity import hf_model_for

    base, _ = base_ckpt
    trainer = _lora(base, "--save", str(tmp_path / "run"))
    trainer.load()
    trainer.train_step(), trainer.train_step()
    trainer.save()
    model = trainer.model.eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(x)
    config = trainer.model_config
    hf = hf_model_for(config)
    base_state = {n: p for n, p in model.state_dict().items() if ".lora_" not in n}
    hf.load_state_dict(to_hf(base_state, config), strict=False)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "run" / "adapter")).eval()
    with torch.no_grad():
        assert (peft_model(x).logits - ours).abs().max().item() <= 1e-5
    again = Trainer(
        parse_args(
            [
                *BASE,
                "--load",
                str(base),
                "--finetune",
                "--lora-load",
                str(tmp_path / "run" / "adapter"),
            ]
        )
    )
    again.load()
    with torch.no_grad():
        assert torch.equal(again.model.eval()(x), ours)


def test_bitfit_and_prefix_train_small_adapters(base_ckpt, tmp_path):
    base, base_params = base_ckpt
    for method, expect in (("bitfit", "norm"), ("prefix", "prefix_")):
        trainer = Trainer(
            parse_args(
                [
                    *BASE,
                    "--peft-method",
                    method,
                    "--load",
                    str(base),
                    "--finetune",
                    "--save",
                    str(tmp_path / method),
                ]
            )
        )
        trainer.load()
        trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert trainable and all(expect in n for n in trainable), trainable
        losses = [trainer.train_step().loss for _ in range(4)]
        assert all(torch.isfinite(torch.tensor(losses)))
        changed = [
            n
            for n, p in trainer.model.named_parameters()
            if n in base_params and not torch.equal(p, base_params[n])
        ]
        assert set(changed) <= set(trainable)
        if method == "bitfit":
            assert changed  # the norms moved
        trainer.save()
        resumed = Trainer(
            parse_args(
                [
                    *BASE,
                    "--peft-method",
                    method,
                    "--load",
                    str(base),
                    "--finetune",
                    "--lora-load",
                    str(tmp_path / method),
                ]
            )
        )
        assert resumed.load() == 4
        for name, p in resumed.model.named_parameters():
            assert torch.equal(p, dict(trainer.model.named_parameters())[name]), name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([*LORA, "--load", "x"], "add --finetune"),
        (["--lora-r", "0", *LORA[:2]], "--lora-r"),
        (["--peft-method", "bitfit", "--lora-target-modules", "dense"], "--peft-method is bitfit"),
        (["--peft-method", "lora"], "needs --lora-target-modules"),
        (["--lora-target-modules", "attn"], "unknown module"),
    ],
)
def test_bad_flags_are_named(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args([*BASE, *flags]).validate(1)


@pytest.mark.parametrize(
    "recompute", [["--recompute-granularity", "full"], ["--recompute-activations"]]
)
def test_lora_with_recompute_equals_without(recompute):
    """Activation recompute around LoRA layers gives the same losses and adapters."""
    plain = Trainer(parse_args([*BASE, *LORA]))
    again = Trainer(parse_args([*BASE, *LORA, *recompute]))
    for _ in range(3):
        assert again.train_step().loss == pytest.approx(plain.train_step().loss, rel=1e-6)
    from training.finetune import clean_name

    ours = {clean_name(n): p for n, p in again.model.named_parameters()}
    lora = [(clean_name(n), p) for n, p in plain.model.named_parameters() if ".lora_" in n]
    assert lora
    for name, p in lora:
        torch.testing.assert_close(ours[name], p, rtol=1e-6, atol=1e-7)
