"""`meshline estimate`: the table it prints and its errors."""

from __future__ import annotations

from models.accounting import count_parameters
from models.config import ModelConfig
from models.estimate import main
from models.memory import TrainingLayout, estimate
from models.registry import get_config
from services.cli import main as meshline


def test_prints_per_stage_table(capsys):
    argv = [
        "--model", "llama2-70B",
        "--tensor-model-parallel-size", "8",
        "--pipeline-model-parallel-size", "4",
        "--world-size", "64",
        "--zero-stage", "1",
        "--bf16",
        "--sequence-parallel",
        "--recompute-granularity", "selective",
        "--seq-length", "4096",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "68.98B parameters" in out
    assert "TP=8 PP=4 (virtual 1) DP=2 world=64 ZeRO-1 bf16" in out
    lines = {line.split()[0]: line for line in out.splitlines() if "stage" in line}
    assert set(lines) == {"first", "middle", "last"}
    layout = TrainingLayout(
        tensor_parallel=8,
        pipeline_parallel=4,
        data_parallel=2,
        zero_stage=1,
        precision="bf16",
        sequence_parallel=True,
        recompute="selective",
        seq_length=4096,
    )
    first = estimate(get_config("llama2-70B"), layout)[0]
    assert f"{first.total / 2**30:9.2f}" in lines["first"]


def test_size_flags_and_subcommand_dispatch(capsys):
    argv = ["estimate", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4"]
    assert meshline(argv) == 0
    out = capsys.readouterr().out
    config = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024)
    assert f"{count_parameters(config) / 1e6:.2f}M parameters" in out


def test_bad_layouts_fail_with_the_flag(capsys):
    assert (
        main(["--model", "tiny-llama", "--world-size", "6", "--tensor-model-parallel-size", "4"])
        == 2
    )
    assert "--world-size 6 is not a multiple of TP·PP = 4" in capsys.readouterr().err
    assert main(["--num-layers", "2"]) == 2
    assert "missing --hidden-size, --num-attention-heads" in capsys.readouterr().err
    assert main(["--model", "tiny-llama", "--sequence-parallel"]) == 2
    assert "--sequence-parallel needs" in capsys.readouterr().err


def test_auto_ranks_layouts_that_fit_and_the_dry_run_agrees(capsys, tmp_path):
    """--auto's best layout for LLaMA2-70B on 64 x 64 GiB, then that very command dry-run."""
    import shlex

    from services.trainer.arguments import parse_args
    from training.dry_run import dry_run

    argv = [
        "--model", "llama2-70B", "--auto", "--world-size", "64", "--device-memory", "64GiB",
        "--global-batch-size", "64", "--seq-length", "4096", "--top", "3",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    command = out.strip().splitlines()[-1]
    assert command.startswith("meshline train --nproc-per-node 8 --nnodes 8 --model llama2-70B")
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 3
    assert all(float(row.split()[8]) <= 64 for row in rows)  # peak GiB column
    train_flags = shlex.split(command)[6:]  # after "meshline train --nproc-per-node 8 --nnodes 8"
    report = dry_run(parse_args(["--mock-data", *train_flags]), 64, 64 * 2**30)
    assert report["fits"]["ok"] is True


def test_auto_says_when_nothing_fits(capsys):
    argv = ["--model", "llama2-70B", "--auto", "--world-size", "2", "--device-memory", "16GiB"]
    assert main(argv) == 1
    assert "no layout of 2 devices fits 16GiB" in capsys.readouterr().out
    assert main(["--model", "llama2-70B", "--auto"]) == 2


def test_auto_refuses_the_layout_flags_it_chooses_itself(capsys):
    """--auto picks TP, PP, DP, ZeRO, recompute and micro-batch: a layout flag given with it,
    even at its default value, is refused by name instead of being silently ignored."""
    base = ["--model", "llama2-7B", "--auto", "--world-size", "8", "--device-memory", "80GiB"]
    for extra in (["--zero-stage", "0"], ["--micro-batch-size", "4"], ["--optimizer", "sgd"]):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert f"drop {extra[0]}" in err, err
    assert main([*base, "--tensor-model-parallel-size", "2", "--sequence-parallel"]) == 2
    assert "drop --tensor-model-parallel-size --sequence-parallel" in capsys.readouterr().err
    assert main(base) == 0
