"""A TP size that does not divide the heads, or a PP size that does not divide the layers, is
refused by `meshline serve inference`, `meshline convert` and `meshline train` from the model's
config alone: in under 2 s, before any rank is spawned or weight read, with a non-zero exit code
and one stderr line naming the flag as that command spells it, no traceback. Timed in-process
(the CLI's `main`), so the bound measures the check, not the interpreter start-up on a busy
machine."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services import cli as meshline

BOUND_S = 2.0
SIX_HEADS_THREE_LAYERS = dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """An HF Llama with 6 heads and 3 layers (TP 4 and PP 2 cannot split it)."""
    config = LlamaConfig(vocab_size=96, intermediate_size=64, max_position_embeddings=64,
                         **SIX_HEADS_THREE_LAYERS)  # fmt: skip
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("hf") / "six-heads"
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    start = time.perf_counter()
    code = meshline.main(argv)
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code != 0 and elapsed < BOUND_S, (code, elapsed, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert multiprocessing.active_children() == []  # no rank was spawned
    return err


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--tensor-parallel-size", "4"], ["--tensor-parallel-size 4", "num_attention_heads 6"]),
        (["--pipeline-parallel-size", "2"], ["--pipeline-parallel-size 2", "num_layers 3"]),
    ],
)
def test_serve_refuses_a_layout_the_config_rules_out(hf_dir, capsys, flags, names):
    err = _refused(["serve", "inference", "--port", "0", "--load", str(hf_dir), *flags], capsys)
    assert all(name in err for name in names), err
    assert "--tensor-model-parallel-size" not in err


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--target-tensor-parallel-size", "4"], ["--target-tensor-parallel-size 4", "heads 6"]),
        (["--target-pipeline-parallel-size", "2"], ["--target-pipeline-parallel-size 2", "3"]),
    ],
)
def test_convert_refuses_a_layout_the_config_rules_out(hf_dir, tmp_path, capsys, flags, names):
    out = tmp_path / "mg"
    argv = ["convert", "--load-format", "hf", "--save-format", "megatron", "--load-dir",
            str(hf_dir), "--save-dir", str(out), *flags]  # fmt: skip
    err = _refused(argv, capsys)
    assert all(name in err for name in names), err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--nproc-per-node", "4", "--tensor-model-parallel-size", "4"],
         ["--tensor-model-parallel-size 4", "num_attention_heads 6"]),
        (["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"],
         ["--pipeline-model-parallel-size 2", "num_layers 3"]),
    ],
)  # fmt: skip
def test_train_refuses_a_layout_the_model_rules_out(tmp_path, capsys, flags, names):
    argv = ["train", *flags, "--model", "tiny-llama", "--hidden-size", "48",
            "--num-attention-heads", "6", "--num-layers", "3", "--mock-data", "--train-iters",
            "1", "--save", str(tmp_path / "run")]  # fmt: skip
    err = _refused(argv, capsys)
    assert all(name in err for name in names), err
    assert not (tmp_path / "run").exists()


def test_train_refuses_sequence_parallel_with_learned_positions(capsys):
    argv = ["train", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--mock-data"]  # fmt: skip
    err = _refused(argv, capsys)
    assert "--sequence-parallel" in err and "learned" in err
