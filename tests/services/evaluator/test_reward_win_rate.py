"""The `rm_win_rate` task: a policy's win rate and mean reward margin against its reference under
a reward model, in process (`--load`, `--reference-load`, `--reward-load`) and with the reference
and reward model served (`--reference-endpoint`, `--reward-endpoint`); each equal to a
computation with transformers alone (greedy `generate` of both causal LMs on the prompt with BOS,
the answers decoded, then AutoModelForSequenceClassification on prompt with BOS + answer ids +
EOS, rm_pairs' encoding). A policy that is its own reference ties everywhere (0.5); flags and
checkpoint kinds that cannot serve are refused, naming the flag, before any model is opened."""

from __future__ import annotations

import json

import pytest
import sentencepiece

from services.evaluator.cli import main
from services.inference.config import InferenceServiceConfig
from services.inference.servicer import bindings as inference_bindings
from services.inference.servicer import load_engine
from tests.services.evaluator.servers import ServerThread
from tests.services.inference.helpers import hf_generate
from tests.services.inference.http_served import make_checkpoint
from tests.services.inference.test_reward_served import hf_rewards, make_reward_checkpoint

PROMPTS = [f"Question {i}: which animal sat on the mat?" for i in range(5)] + [
    "Say hello.",
    "The cat",
]
MAX_NEW = 6
EOS = 2


def _hf_answers(hf, sp) -> list[str]:
    """transformers' greedy answers, decoded by the checkpoint's sentencepiece model."""
    answers = []
    for prompt in PROMPTS:
        ids = [sp.bos_id(), *sp.encode(prompt)]
        out = hf_generate(hf, ids, max_new_tokens=MAX_NEW, eos_token_id=EOS)
        answers.append(sp.decode([t for t in out[0, len(ids) :].tolist() if t != EOS]))
    return answers


@pytest.fixture(scope="module")
def setup(tmp_path_factory, sentencepiece_model):
    root = tmp_path_factory.mktemp("win_rate")
    policy, policy_hf, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=2)
    reference, reference_hf, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=3)
    rm = make_reward_checkpoint(root / "rm", sentencepiece_model, seed=11)
    data = root / "data"
    data.mkdir()
    (data / "rm_win_rate.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    answers = {"policy": _hf_answers(policy_hf, sp), "reference": _hf_answers(reference_hf, sp)}
    assert answers["policy"] != answers["reference"]
    rows = [
        [sp.bos_id(), *sp.encode(prompt), *sp.encode(answers[side][i]), EOS]
        for i, prompt in enumerate(PROMPTS)
        for side in ("policy", "reference")
    ]
    rewards = hf_rewards(rm, rows)
    margins = [rewards[2 * i] - rewards[2 * i + 1] for i in range(len(PROMPTS))]
    wins = [1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins]
    expected = {
        "win_rate,none": sum(wins) / len(wins),
        "reward_margin,none": sum(margins) / len(margins),
    }
    assert 0 < expected["win_rate,none"] < 1  # random models: both outcomes occur
    return {"policy": policy, "reference": reference, "rm": rm, "data": data,
            "answers": answers, "expected": expected}  # fmt: skip


def _argv(setup, out, *extra: str) -> list[str]:
    return ["--tasks", "rm_win_rate", "--task-data-path", str(setup["data"]), "--output-path",
            str(out), "--no-progress", "--max-new-tokens", str(MAX_NEW), *extra]  # fmt: skip


def _results(out) -> dict:
    return json.loads((out / "results.json").read_text())["results"]["rm_win_rate"]


def _check(out, setup) -> None:
    results = _results(out)
    expected = setup["expected"]
    assert results["win_rate,none"] == pytest.approx(expected["win_rate,none"], abs=1e-9)
    assert results["reward_margin,none"] == pytest.approx(expected["reward_margin,none"], abs=1e-5)
    lines = (out / "samples_rm_win_rate.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert [s["resps"][0] for s in samples] == setup["answers"]["policy"]
    assert [s["resps"][1] for s in samples] == setup["answers"]["reference"]


def test_in_process_equals_transformers(setup, tmp_path, capsys, monkeypatch):
    from services.evaluator.models import local

    argv = _argv(setup, tmp_path, "--load", str(setup["policy"]), "--reference-load",
                 str(setup["reference"]), "--reward-load", str(setup["rm"]))  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    _check(tmp_path, setup)
    assert "|rm_win_rate|" in capsys.readouterr().out
    # A rerun answers from the cache: the same scores, no generation or reward computed.
    first = _results(tmp_path)

    def never(*args, **kwargs):
        raise AssertionError("a cached answer was asked again")

    monkeypatch.setattr(local.LocalLanguageModel, "generate_ids", never)
    monkeypatch.setattr(local.LocalLanguageModel, "reward_ids", never)
    assert main(argv) == 0, capsys.readouterr().err
    assert _results(tmp_path) == first


def test_policy_that_is_its_reference_ties_everywhere(setup, tmp_path, capsys):
    argv = _argv(setup, tmp_path, "--load", str(setup["policy"]), "--reference-load",
                 str(setup["policy"]), "--reward-load", str(setup["rm"]))  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    results = _results(tmp_path)
    assert results["win_rate,none"] == 0.5
    assert results["reward_margin,none"] == 0.0


def test_served_reference_and_reward_model(setup, tmp_path, capsys):
    reference_config = InferenceServiceConfig(load=setup["reference"], load_format="hf")
    reward_config = InferenceServiceConfig(load=setup["rm"])
    reference = ServerThread(inference_bindings(reference_config, load_engine(reference_config)))
    reward = ServerThread(inference_bindings(reward_config, load_engine(reward_config)))
    try:
        argv = _argv(setup, tmp_path, "--load", str(setup["policy"]), "--reference-endpoint",
                     reference.address, "--reward-endpoint", reward.address,
                     "--batch-size", "3")  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
        _check(tmp_path, setup)
        # Served models of the wrong kind are refused by the server; the error names our flag.
        swapped = _argv(setup, tmp_path / "swapped", "--load", str(setup["policy"]),
                        "--reference-endpoint", reward.address, "--reward-endpoint",
                        reference.address)  # fmt: skip
        assert main(swapped) == 2
        assert f"--reference-endpoint {reward.address}" in capsys.readouterr().err
    finally:
        reference.stop()
        reward.stop()


def test_refusals_name_the_flag_before_any_model_is_opened(setup, tmp_path, capsys, monkeypatch):
    from services.evaluator.models import local

    def never(*args, **kwargs):
        raise AssertionError("a model was opened")

    monkeypatch.setattr(local.LocalLanguageModel, "__init__", never)
    policy, reference, rm = (str(setup[k]) for k in ("policy", "reference", "rm"))
    for extra, message in (
        (["--load", policy, "--reward-load", rm], "give --reference-load/--reference-endpoint"),
        (["--load", policy, "--reference-load", reference], "give --reward-load/--reward-endpoint"),
        (["--load", policy, "--reference-load", reference, "--reward-load", reference],
         f"--reward-load {reference} is a causal LM, not a reward model"),
        (["--load", policy, "--reference-load", rm, "--reward-load", rm],
         f"--reference-load {rm} is a reward model"),
        (["--load", rm, "--reference-load", reference, "--reward-load", rm],
         f"--load {rm} is a reward model"),
        (["--load", policy, "--reference-load", reference, "--reward-load", rm,
          "--num-fewshot", "1"], "--num-fewshot 1"),
    ):  # fmt: skip
        assert main(_argv(setup, tmp_path, *extra)) == 2, extra
        assert message in capsys.readouterr().err, extra
    # Other tasks take neither extra model.
    argv = ["--tasks", "boolq", "--task-data-path", str(setup["data"]), "--load", policy,
            "--reward-endpoint", "localhost:1", "--output-path", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    assert "--reward-endpoint: only task rm_win_rate uses" in capsys.readouterr().err


def test_bad_prompt_records_name_the_line(tmp_path):
    from services.evaluator.tasks import get_task

    task = get_task("rm_win_rate")
    for line, message in (
        (json.dumps({"text": "p"}), "'prompt' must be a non-empty string"),
        (json.dumps({"prompt": ""}), "'prompt' must be a non-empty string"),
        (json.dumps(["p"]), "a record must be a JSON object"),
        ("{", "not a JSON line"),
    ):
        (tmp_path / "rm_win_rate.jsonl").write_text(line + "\n")
        with pytest.raises(ValueError, match=rf"rm_win_rate.jsonl:1: .*{message}"):
            task.load(tmp_path)


def test_evaluator_service(setup, tmp_path, tmp_path_factory):
    """StartEvaluation with reference_local and reward_local gives the CLI's scores; requests
    that cannot run are refused (INVALID_ARGUMENT naming the field) before any job starts."""
    import grpc

    from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
    from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
    from services.common.operations import OperationsStore
    from services.evaluator.config import EvaluatorServiceConfig
    from services.evaluator.servicer import bindings

    def local(key: str) -> evaluator_pb2.LocalModel:
        return evaluator_pb2.LocalModel(
            load_dir=str(setup[key]), load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF
        )

    roots = (tmp_path_factory.getbasetemp(),)
    evaluator = ServerThread(
        bindings(EvaluatorServiceConfig(data_roots=roots), OperationsStore(None))
    )
    channel = grpc.insecure_channel(evaluator.address)
    try:
        stub = evaluator_pb2_grpc.EvaluatorServiceStub(channel)
        ops = operations_pb2_grpc.OperationsServiceStub(channel)

        def request(**fields) -> evaluator_pb2.StartEvaluationRequest:
            base = dict(tasks=["rm_win_rate"], task_data_path=str(setup["data"]),
                        output_path=str(tmp_path / "out"), max_new_tokens=MAX_NEW,
                        local=local("policy"))  # fmt: skip
            return evaluator_pb2.StartEvaluationRequest(**{**base, **fields})

        good = request(reference_local=local("reference"), reward_local=local("rm"))
        started = stub.StartEvaluation(good).operation
        done = ops.WaitOperation(
            operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=120)
        ).operation
        assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
        _check(tmp_path / "out", setup)

        for bad, message in (
            (request(reward_local=local("rm")), "reference: task rm_win_rate needs"),
            (request(reference_local=local("reference"), reward_endpoint="no port"),
             "reward_endpoint: 'no port' is not host:port"),
            (request(tasks=["boolq"], reward_endpoint="localhost:1"),
             "reward_endpoint: only task rm_win_rate uses it"),
            (request(reference_local=local("reference"), reward_local=local("reference")),
             "reward_local.load_dir: "),
            (request(reference_local=local("rm"), reward_local=local("rm")),
             "reference_local.load_dir: "),
            (request(local=local("rm"), reference_local=local("reference"),
                     reward_local=local("rm")), "local.load_dir: "),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                stub.StartEvaluation(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert message in err.value.details(), err.value.details()
    finally:
        channel.close()
        evaluator.stop()
