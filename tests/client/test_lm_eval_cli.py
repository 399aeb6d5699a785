"""lm-eval's own CLI runs tasks against a Meshline server both ways: `--model local-completions`
on the OpenAI HTTP API and `--model meshline` over gRPC, with the same scores.

The tasks are local YAML tasks on JSON files (no downloads): one multiple-choice task
(loglikelihood) and one generate_until task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.served_process import GRPC_PORT, HTTP_PORT, launched
from tests.services.inference.http_served import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PORTS = {"grpc": GRPC_PORT, "http": HTTP_PORT}
MC_TASK = """task: meshline_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: meshline_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""


def _tasks(directory: Path) -> Path:
    questions = ["one two three", "the cat sat on the", "a b c d", "hello there my", "we go to"]
    mc = [
        {"question": q, "choices": [" four", " mat", " e", " friend"], "label": i % 4}
        for i, q in enumerate(questions)
    ]
    gen = [{"question": q, "answer": " four"} for q in questions]
    (directory / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (directory / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
    (directory / "mc.yaml").write_text(MC_TASK.format(data=directory / "mc.jsonl"))
    (directory / "gen.yaml").write_text(GEN_TASK.format(data=directory / "gen.jsonl"))
    return directory


def _lm_eval(module: str, model: str, model_args: str, tasks: Path, out: Path) -> dict:
    command = [sys.executable, "-m", module, "run", "--model", model, "--model_args", model_args]
    command += ["--tasks", "meshline_tiny_mc,meshline_tiny_gen", "--include_path", str(tasks)]
    command += ["--output_path", str(out), "--log_samples", "--batch_size", "4"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = list(out.rglob("results*.json"))
    return json.loads(result.read_text())["results"]


@pytest.mark.slow
def test_lm_eval_cli_local_completions_and_meshline_agree(
    tmp_path, tmp_path_factory, sentencepiece_model
):
    directory, _, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=8)
    tasks = _tasks(tmp_path_factory.mktemp("tasks"))
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(directory), "--http-port", "0", "--served-model-name", "tiny"]
    with launched(command, PORTS, ready_s=120) as server:
        ports = server.ports
        http = _lm_eval(
            "lm_eval",
            "local-completions",
            f"model=tiny,base_url=http://127.0.0.1:{ports['http']}/v1/completions,"
            "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=2",
            tasks,
            tmp_path / "http",
        )
        grpc_ = _lm_eval(
            "meshline_client.lm_eval_cli",
            "meshline",
            f"endpoint=127.0.0.1:{ports['grpc']}",
            tasks,
            tmp_path / "grpc",
        )
    for task, metric in (
        ("meshline_tiny_mc", "acc,none"),
        ("meshline_tiny_gen", "exact_match,none"),
    ):
        assert http[task][metric] == pytest.approx(grpc_[task][metric]), (task, http, grpc_)
