"""`meshline evaluate` against a running InferenceService: table, files, exit codes."""

from __future__ import annotations

import json

from services.evaluator.cli import main
from tests.services.evaluator.lm_eval_ref import FIXTURES


def test_cli_evaluates_and_writes_results(served, tmp_path, capsys):
    _, server = served
    argv = [
        "--tasks", "boolq,mmlu_anatomy", "--task-data-path", str(FIXTURES),
        "--endpoint", server.address, "--output-path", str(tmp_path), "--limit", "2",
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "|boolq|2.0|none|0|acc|" in out and "|mmlu_anatomy|1.0|none|5|acc|" in out
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["config"]["model_args"] == server.address
    assert document["config"]["num_samples"] == 1 and document["config"]["temperature"] is None
    assert document["n-samples"]["mmlu_anatomy"]["effective"] == 2
    assert (tmp_path / "samples_boolq.jsonl").is_file()


def test_cli_errors_exit_2_naming_the_problem(served, tmp_path, capsys):
    _, server = served
    base = ["--task-data-path", str(FIXTURES), "--output-path", str(tmp_path)]
    assert main(["--tasks", "mmlu_klingon", *base, "--endpoint", server.address]) == 2
    assert "unknown task name(s) ['mmlu_klingon']" in capsys.readouterr().err
    assert main(["--tasks", "boolq", *base, "--endpoint", "127.0.0.1:1"]) == 2
    assert "127.0.0.1:1" in capsys.readouterr().err
    assert main(["--tasks", "boolq", *base, "--endpoint", server.address, "--limit", "0"]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err


def test_unknown_tasks_list_the_known_ones_before_opening_a_model(tmp_path, capsys):
    argv = ["--tasks", "boolq,agieval_maths", "--task-data-path", str(FIXTURES),
            "--endpoint", "127.0.0.1:1", "--output-path", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown task name(s) ['agieval_maths']" in err and "127.0.0.1:1" not in err
    for name in ("agieval_gaokao_mathcloze", "agieval_math", "gsm8k", "gsm8k_cot", "humaneval"):
        assert f" {name}," in err
    assert main(["--list-tasks"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert {"agieval (group of 21)", "agieval_math", "agieval_gaokao_mathcloze", "gsm8k"} <= set(
        listed
    )


def test_num_samples_or_temperature_without_humaneval_sampling_are_refused(tmp_path, capsys):
    def run(tasks: str) -> int:
        return main(
            ["--tasks", tasks, "--task-data-path", str(FIXTURES), "--num-samples", "4",
             "--endpoint", "127.0.0.1:1", "--output-path", str(tmp_path)]
        )  # fmt: skip

    assert run("gsm8k") == 2
    assert "--num-samples 4 applies to humaneval only" in capsys.readouterr().err
    assert run("gsm8k,humaneval") == 2  # nothing listens on the endpoint
    assert "applies to humaneval only" not in capsys.readouterr().err
    argv = ["--tasks", "humaneval", "--task-data-path", str(FIXTURES), "--temperature", "0.2",
            "--endpoint", "127.0.0.1:1", "--output-path", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    assert "--temperature applies to humaneval's sampled completions" in capsys.readouterr().err
