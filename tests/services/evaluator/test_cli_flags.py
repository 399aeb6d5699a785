"""`meshline evaluate`'s command line, pinned: every spelling it has taken parses, and a set of
command lines (ModelLink's evaluation-script spellings among them) reaches the model, the judges,
`evaluate` and results.json with the same values as when the flags were written by hand. The
expected values were produced by that hand-written parser and `main` and are hard-coded here; the
model layer is replaced by a recorder, so no model is opened."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from services.common import megatron_compat
from services.evaluator import cli

# the command's own spellings -> a value each accepts ([] for a switch); the ModelLink rows of
# services/common/megatron_compat.py come on top
SPELLINGS: dict[str, list[str]] = {
    "--tasks": ["boolq"], "--task": ["boolq"], "--list-tasks": [], "--task-data-path": ["d"],
    "--endpoint": ["h:1"], "--load": ["ck"], "--load-format": ["hf"],
    "--reference-load": ["r"], "--reference-endpoint": ["h:2"], "--reward-load": ["w"],
    "--reward-endpoint": ["h:3"], "--tokenizer": ["t"], "--tokenizer-name-or-path": ["t"],
    "--tokenizer-model": ["t"], "--add-bos-token": ["true"], "--num-fewshot": ["2"],
    "--limit": ["3"], "--batch-size": ["4"], "--evaluation-batch-size": ["4"],
    "--dtype": ["float16"], "--max-new-tokens": ["5"], "--max-new-token": ["5"],
    "--output-path": ["o"], "--seed": ["6"], "--num-samples": ["7"], "--temperature": ["0.5"],
    "--no-progress": [], "--allow-unsafe-code-execution": [],
}  # fmt: skip

NO_JUDGES = dict(reference_load=None, reference_endpoint=None, reward_load=None,
                 reward_endpoint=None)  # fmt: skip
BASE = dict(num_fewshot=None, limit=None, batch_size=8, max_new_tokens=None, seed=1234,
            num_samples=1, temperature=0.8, allow_unsafe_code_execution=False, extra={},
            output_path=Path("runs/eval"))  # fmt: skip
MODEL = dict(endpoint=None, load=None, load_format="auto", tokenizer=None, add_bos_token=None,
             dtype=None, batch_size=8)  # fmt: skip
SETTINGS = dict(limit=None, random_seed=1234, fewshot_seed=1234, num_samples=1, temperature=None,
                batch_size=8)  # fmt: skip

CASES = [
    ("--tasks mmlu,gsm8k_cot --task-data-path data/eval --endpoint localhost:50054 "
     "--output-path runs/x --num-fewshot 5 --limit 10",
     {**MODEL, "endpoint": "localhost:50054"}, ({}, []), NO_JUDGES,
     {**BASE, "tasks": ("mmlu", "gsm8k_cot"), "task_data_path": Path("data/eval"),
      "output_path": Path("runs/x"), "num_fewshot": 5, "limit": 10}, None,
     {**SETTINGS, "model": "meshline-grpc", "model_args": "localhost:50054", "limit": 10}),
    ("--task boolq --task-data-path d --load ck --load-format hf --evaluation-batch-size 4 "
     "--tokenizer-name-or-path tok --add-bos-token false --dtype bfloat16 --max-new-token 16 "
     "--seed 7 --no-progress",
     {**MODEL, "load": Path("ck"), "load_format": "hf", "tokenizer": Path("tok"),
      "add_bos_token": "false", "dtype": "bfloat16", "batch_size": 4}, ({}, []), NO_JUDGES,
     {**BASE, "tasks": ("boolq",), "task_data_path": Path("d"), "batch_size": 4,
      "max_new_tokens": 16, "seed": 7}, False,
     {**SETTINGS, "model": "meshline-local", "model_args": "ck", "batch_size": 4,
      "random_seed": 7, "fewshot_seed": 7}),
    # ModelLink's evaluation script: its task name, model flags checked, batch and dtype mapped
    ("--task human_eval --task-data-path d --load ck --micro-batch-size 2 --fp16 --num-layers 2 "
     "--seq-length 32 --tensor-model-parallel-size 1 --num-samples 5 --temperature 0.5 "
     "--allow-unsafe-code-execution --tokenizer-model tok.model --use-flash-attn",
     {**MODEL, "load": Path("ck"), "tokenizer": Path("tok.model"), "dtype": "float16",
      "batch_size": 2}, ({"batch_size": 2, "dtype": "float16"}, ["--num-layers", "--seq-length"]),
     NO_JUDGES,
     {**BASE, "tasks": ("humaneval",), "task_data_path": Path("d"), "batch_size": 2,
      "num_samples": 5, "temperature": 0.5, "allow_unsafe_code_execution": True}, None,
     {**SETTINGS, "model": "meshline-local", "model_args": "ck", "batch_size": 2,
      "num_samples": 5, "temperature": 0.5}),
    ("--tasks rm_win_rate --task-data-path p --endpoint h:1 --reference-endpoint h:2 "
     "--reward-endpoint h:3 --max-new-tokens 64 --batch-size 3",
     {**MODEL, "endpoint": "h:1", "batch_size": 3}, ({}, []),
     {**NO_JUDGES, "reference_endpoint": "h:2", "reward_endpoint": "h:3"},
     {**BASE, "tasks": ("rm_win_rate",), "task_data_path": Path("p"), "batch_size": 3,
      "max_new_tokens": 64}, None,
     {**SETTINGS, "model": "meshline-grpc", "model_args": "h:1", "batch_size": 3}),
    ("--tasks 'boolq ceval' --task-data-path d --load ck --bf16 --add-bos-token true",
     {**MODEL, "load": Path("ck"), "add_bos_token": "true", "dtype": "bfloat16"},
     ({"dtype": "bfloat16"}, []), NO_JUDGES,
     {**BASE, "tasks": ("boolq", "ceval-valid"), "task_data_path": Path("d")}, None,
     {**SETTINGS, "model": "meshline-local", "model_args": "ck"}),
]  # fmt: skip

ERRORS = [
    ("--tasks boolq --task-data-path d --load ck --num-samples 2",
     "--num-samples 2 applies to humaneval only"),
    ("--tasks humaneval --task-data-path d --load ck --temperature 0.5 "
     "--allow-unsafe-code-execution", "--temperature applies to humaneval's sampled completions"),
    ("--tasks rm_win_rate --task-data-path d --endpoint h:1 --reward-endpoint h:3",
     "give --reference-load/--reference-endpoint"),
    ("--tasks boolq --task-data-path d --endpoint h:1 --reward-endpoint h:3",
     "--reward-endpoint: only task rm_win_rate uses a reference and a reward model"),
    ("--tasks boolq --task-data-path d --load ck --bf16 --dtype float16",
     "--bf16 means --dtype bfloat16, but --dtype float16 is given"),
    ("--tasks boolq --task-data-path d --load ck --deepspeed-config ds.json",
     "--deepspeed-config is not supported here"),
    ("--tasks boolq --task-data-path nowhere --load ck", "--task-data-path nowhere does not exist"),
]  # fmt: skip


class _Model:
    name = "recorded"

    def close(self) -> None:
        pass


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """main() with the model layer and results writer recording what they were given."""
    for name in ("d", "p", "data/eval"):
        (tmp_path / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    seen: dict = {}

    def open_model(args, compat=None):
        seen["model"] = {key: getattr(args, key) for key in MODEL}
        seen["compat"] = (compat.settings, [row.flag for row, _ in compat.checks])
        return _Model()

    def open_judges(args):
        seen["judges"] = {key: getattr(args, key) for key in NO_JUDGES}
        return None

    def evaluate(config, model, judges=None, show_bar=None):
        seen["config"], seen["show_bar"] = dataclasses.asdict(config), show_bar
        return []

    def write_results(path, outcomes, settings, start):
        seen["settings"] = settings
        return Path("results.json"), {}

    for name, value in dict(
        open_model=open_model,
        open_judges=open_judges,
        evaluate=evaluate,
        write_results=write_results,
        format_table=lambda doc: "",
    ).items():
        monkeypatch.setattr(cli, name, value)  # fmt: skip
    return seen


def test_every_spelling_is_a_flag_and_parses():
    parser = cli.build_parser()
    spellings = {s for action in parser._actions for s in action.option_strings}
    compat = {s for row in megatron_compat.TABLE for s in (row.flag, *row.aliases)}
    assert spellings == {"-h", "--help", *SPELLINGS, *compat}
    for flag, values in SPELLINGS.items():
        parser.parse_args([flag, *values])


@pytest.mark.parametrize(
    ("line", "model", "compat", "judges", "config", "show_bar", "settings"), CASES
)
def test_command_lines_reach_the_run_unchanged(
    recorder, line, model, compat, judges, config, show_bar, settings
):
    assert cli.main(shlex.split(line)) == 0
    assert recorder == {
        "model": model,
        "compat": compat,
        "judges": judges,
        "config": config,
        "show_bar": show_bar,
        "settings": settings,
    }


@pytest.mark.parametrize(("line", "message"), ERRORS)
def test_command_lines_give_the_same_errors(recorder, capsys, line, message):
    assert cli.main(shlex.split(line)) == 2
    assert message in capsys.readouterr().err


def test_missing_tasks_or_model_are_usage_errors(recorder, capsys):
    for line, message in (
        ("--tasks boolq", "--tasks and --task-data-path are required"),
        ("--tasks boolq --task-data-path d", "give --endpoint host:port or --load DIR"),
        ("--tasks boolq --task-data-path d --endpoint h:1 --load ck", "not allowed with"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(shlex.split(line))
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
