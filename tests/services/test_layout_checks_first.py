"""A TP size that does not divide the heads, or a PP size that does not divide the layers, is
refused by `meshline serve inference`, `meshline convert` and `meshline train` from the model's
config alone: in under 2 s, before any rank is spawned or weight read, with a non-zero exit code
and one stderr line naming the flag as that command spells it, no traceback. Timed in-process
(the CLI's `main`), so the bound measures the check, not the interpreter start-up on a busy
machine.

As commands (a fresh `meshline` process) the refusals import no torch at all: each command's
torch-free precheck (`services/*/precheck.py`) reads the config file or the flags before the
command's module is imported. The full checks behind them still run (defence in depth) and print
the very same line, which the `*_full_check_*` tests compare."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.registry import get_config
from services import cli as meshline

ROOT = Path(__file__).resolve().parents[2]
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
    # Children this test process already has (the HTTP body-parse pool an earlier test in this
    # worker may have started) are not ranks of this command.
    earlier = set(multiprocessing.active_children())
    start = time.perf_counter()
    code = meshline.main(argv)
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code != 0 and elapsed < BOUND_S, (code, elapsed, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert set(multiprocessing.active_children()) <= earlier  # no rank was spawned
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


# `meshline ARGS` in a fresh interpreter that reports on stdout whether torch was ever imported.
_WRAPPER = (
    "import sys\n"
    "from services import cli\n"
    "code = cli.main(sys.argv[1:])\n"
    "print('torch imported' if 'torch' in sys.modules else 'torch never imported')\n"
    "sys.exit(code)\n"
)


def _command(argv: list[str]) -> str:
    """Runs `meshline argv` as a subprocess; asserts a torch-free one-line refusal; its stderr."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
    )
    err = done.stderr
    assert done.returncode != 0, (done.returncode, done.stdout, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert done.stdout.strip().splitlines()[-1] == "torch never imported", done.stdout
    return err


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory):
    """A native save directory (`latest` → step-000001/config.json) of a 9-head, 3-layer model:
    the check reads only the config, so the step holds no weights."""
    directory = tmp_path_factory.mktemp("native") / "run"
    step = directory / "step-000001"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    config = get_config("tiny-llama", hidden_size=72, num_attention_heads=9, num_kv_heads=3,
                        num_layers=3)  # fmt: skip
    (step / "config.json").write_text(json.dumps(config.to_dict()))
    (directory / "latest").write_text("1\n")
    return directory


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--tensor-parallel-size", "4"], ["--tensor-parallel-size 4", "num_attention_heads 6"]),
        (["--pipeline-parallel-size", "2"], ["--pipeline-parallel-size 2", "num_layers 3"]),
    ],
)
def test_serve_command_refuses_without_torch(hf_dir, flags, names):
    err = _command(["serve", "inference", "--port", "0", "--load", str(hf_dir), *flags])
    assert err.startswith("inference serve: ") and all(name in err for name in names), err


def test_serve_command_reads_a_native_config_without_torch(native_dir):
    argv = ["serve", "inference", "--port", "0", "--load", str(native_dir),
            "--tensor-parallel-size", "2"]  # fmt: skip
    err = _command(argv)
    assert "--tensor-parallel-size 2" in err and "num_attention_heads 9" in err, err


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--target-tensor-parallel-size", "4"], ["--target-tensor-parallel-size 4", "heads 6"]),
        # ModelLink's spelling: the message names the flag as the converter documents it.
        (["--tensor-model-parallel-size", "4"], ["--target-tensor-parallel-size 4", "heads 6"]),
        (["--target-pipeline-parallel-size", "2"], ["--target-pipeline-parallel-size 2", "3"]),
    ],
)
def test_convert_command_refuses_without_torch(hf_dir, tmp_path, flags, names):
    out = tmp_path / "mg"
    argv = ["convert", "--load-format", "hf", "--save-format", "megatron", "--load-dir",
            str(hf_dir), "--save-dir", str(out), *flags]  # fmt: skip
    err = _command(argv)
    assert err.startswith("meshline convert: error: ") and all(n in err for n in names), err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--tensor-model-parallel-size", "2"],
         ["--tensor-model-parallel-size 2", "num_attention_heads 9"]),
        (["--pipeline-model-parallel-size", "2"],
         ["--pipeline-model-parallel-size 2", "num_layers 3"]),
    ],
)  # fmt: skip
def test_train_command_refuses_without_torch(tmp_path, flags, names):
    argv = ["train", "--nproc-per-node", "2", *flags, "--model", "tiny-llama", "--hidden-size",
            "72", "--num-attention-heads", "9", "--num-layers", "3", "--mock-data",
            "--train-iters", "1", "--save", str(tmp_path / "run")]  # fmt: skip
    err = _command(argv)
    assert err.startswith("meshline train: ") and all(name in err for name in names), err
    assert not (tmp_path / "run").exists()


def _full_check(command: str, argv: list[str], capsys) -> str:
    """stderr of the command's own module (no precheck), which must refuse with one line."""
    capsys.readouterr()
    if command == "serve":
        code = importlib.import_module("services.inference.__main__").main(["serve", *argv])
    else:
        code = importlib.import_module(meshline.SUBCOMMANDS[command].module).main(argv)
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1, (code, err)
    return err


@pytest.mark.parametrize(
    "command, argv",
    [
        ("serve", ["--port", "0", "--load", "{hf}", "--tensor-parallel-size", "4"]),
        ("serve", ["--port", "0", "--load", "{hf}", "--pipeline-parallel-size", "2"]),
        ("convert", ["--load-format", "hf", "--save-format", "megatron", "--load-dir", "{hf}",
                     "--save-dir", "{out}", "--target-tensor-parallel-size", "4"]),
        ("convert", ["--load-format", "hf", "--save-format", "megatron", "--load-dir", "{hf}",
                     "--save-dir", "{out}", "--target-pipeline-parallel-size", "2"]),
        ("train", ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--model",
                   "tiny-llama", "--hidden-size", "72", "--num-attention-heads", "9",
                   "--num-layers", "3", "--mock-data"]),
        ("train", ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--model",
                   "tiny-llama", "--hidden-size", "48", "--num-attention-heads", "6",
                   "--num-layers", "3", "--mock-data"]),
    ],
)  # fmt: skip
def test_precheck_and_full_check_print_the_same_line(hf_dir, tmp_path, capsys, command, argv):
    argv = [a.format(hf=hf_dir, out=tmp_path / "out") for a in argv]
    full = _full_check(command, argv, capsys)
    precheck_argv = ["serve", "inference", *argv] if command == "serve" else [command, *argv]
    assert _refused(precheck_argv, capsys) == full
