"""--no-save-optim / --no-save-rng: checkpoints without the optimizer or RNG state, and resuming
from them (Megatron's rule: the load must be told to skip what is not there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from services import cli as meshline
from services.converter.cli import main as convert
from services.trainer.arguments import parse_args
from training.loop import Trainer

BASE = ["--model", "tiny-llama", "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
        "--eval-interval", "0", "--log-interval", "1"]  # fmt: skip


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _keys(step_dir: Path) -> set[str]:
    return set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


def test_checkpoint_without_optimizer_and_rng_state(tmp_path):
    full, lean = tmp_path / "full", tmp_path / "lean"
    Trainer(parse_args([*BASE, "--train-iters", "2", "--save", str(full)])).fit()
    Trainer(parse_args([*BASE, "--train-iters", "2", "--save", str(lean), "--no-save-optim",
                        "--no-save-rng"])).fit()  # fmt: skip
    step_full, step_lean = full / "step-000002", lean / "step-000002"
    assert any(k.startswith("optim.") for k in _keys(step_full))
    assert not any(k.startswith("optim.") for k in _keys(step_lean))
    assert {k for k in _keys(step_full) if k.startswith("model.")} == _keys(step_lean)
    assert (step_full / "rng").is_dir() and not (step_lean / "rng").exists()
    saved = json.loads((step_lean / "train_state.json").read_text())["saved"]
    assert saved == {"optimizer": False, "rng": False}
    # Weights plus AdamW's two moments against the weights alone: about a third.
    assert _size(step_lean) < 0.45 * _size(step_full)


def test_resuming_names_the_flag_before_any_worker_and_then_resumes(tmp_path, capsys):
    save = tmp_path / "ckpt"
    run = [*BASE, "--save", str(save)]
    assert meshline.main(["train", *run, "--train-iters", "2", "--no-save-optim",
                          "--no-save-rng"]) == 0  # fmt: skip
    capsys.readouterr()
    resume = ["train", *run, "--train-iters", "4", "--load", str(save)]
    assert meshline.main(resume) == 2
    err = capsys.readouterr().err
    assert "holds no optimizer state (saved with --no-save-optim): pass --no-load-optim" in err
    assert meshline.main([*resume, "--no-load-optim"]) == 2
    assert "holds no RNG state (saved with --no-save-rng): pass --no-load-rng" in (
        capsys.readouterr().err
    )
    assert meshline.main([*resume, "--no-load-optim", "--no-load-rng"]) == 0
    out = capsys.readouterr().out
    assert "step 3/4" in out and "step-000004" in out
    assert meshline.main([*resume, "--finetune", "--train-iters", "1"]) == 0


def test_the_load_itself_refuses_what_was_not_saved(tmp_path):
    """The check in the checkpoint manager, for a load that skips the launcher's."""
    save = tmp_path / "ckpt"
    Trainer(parse_args([*BASE, "--train-iters", "1", "--save", str(save),
                        "--no-save-optim"])).fit()  # fmt: skip
    trainer = Trainer(parse_args([*BASE, "--train-iters", "2", "--load", str(save)]))
    with pytest.raises(ValueError, match="pass --no-load-optim"):
        trainer.load()
    trainer = Trainer(
        parse_args([*BASE, "--train-iters", "2", "--load", str(save), "--no-load-optim"])
    )
    assert trainer.load() == 1


def test_a_checkpoint_without_optimizer_state_converts_to_hf(tmp_path):
    save = tmp_path / "ckpt"
    Trainer(parse_args([*BASE, "--train-iters", "1", "--save", str(save),
                        "--no-save-optim"])).fit()  # fmt: skip
    out = tmp_path / "hf"
    code = convert(["--load-format", "native", "--save-format", "hf", "--load-dir", str(save),
                    "--save-dir", str(out)])  # fmt: skip
    assert code == 0
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
