"""The `rm_pairs` task: a reward model's accuracy and mean margin on preference pairs, in process
(`meshline evaluate --load`), through the served Reward RPC (`--endpoint`) and through the
evaluator service; each equal to transformers' AutoModelForSequenceClassification on the same
ids (prompt with BOS, response ids, EOS: `meshline preprocess --handler-name preference`'s
encoding of a plain-text pair)."""

from __future__ import annotations

import json

import grpc
import pytest
import sentencepiece
import torch

from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from services.common.operations import OperationsStore
from services.evaluator.cli import main
from services.evaluator.config import EvaluatorServiceConfig
from services.evaluator.servicer import bindings
from services.inference.config import InferenceServiceConfig
from services.inference.servicer import bindings as inference_bindings
from services.inference.servicer import load_engine
from tests.services.evaluator.servers import ServerThread
from tests.services.inference.test_reward_served import hf_rewards, make_reward_checkpoint

PAIRS = [
    {"prompt": f"Question {i}: which animal?", "chosen": f" the cat {i}", "rejected": " no"}
    for i in range(6)
] + [{"prompt": "Say hello.", "chosen": " hello there", "rejected": " the mat sat"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, sentencepiece_model):
    root = tmp_path_factory.mktemp("rm_eval")
    rm = make_reward_checkpoint(root / "rm", sentencepiece_model, seed=11)
    data = root / "data"
    data.mkdir()
    (data / "rm_pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    boolq = {"question": "is it", "passage": "It is.", "answer": True}
    (data / "dev.jsonl").write_text(json.dumps(boolq) + "\n")  # a causal-LM task
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    rows = []  # what preference preprocessing writes: BOS, prompt, reply, EOS
    for pair in PAIRS:
        for side in ("chosen", "rejected"):
            rows.append([sp.bos_id(), *sp.encode(pair["prompt"]), *sp.encode(pair[side]), 2])
    rewards = hf_rewards(rm, rows)
    margins = [rewards[2 * i] - rewards[2 * i + 1] for i in range(len(PAIRS))]
    expected = {
        "acc,none": sum(m > 0 for m in margins) / len(margins),
        "margin,none": sum(margins) / len(margins),
    }
    assert 0 < expected["acc,none"] < 1  # a random model: both outcomes occur
    return root, rm, data, expected


def _check(results: dict, expected: dict) -> None:
    assert results["acc,none"] == pytest.approx(expected["acc,none"], abs=1e-9)
    assert results["margin,none"] == pytest.approx(expected["margin,none"], abs=1e-5)


def test_in_process_equals_transformers(setup, tmp_path, capsys):
    _, rm, data, expected = setup
    argv = ["--tasks", "rm_pairs", "--task-data-path", str(data), "--load", str(rm),
            "--output-path", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    document = json.loads((tmp_path / "results.json").read_text())
    _check(document["results"]["rm_pairs"], expected)
    assert "|rm_pairs|" in capsys.readouterr().out
    sample = json.loads((tmp_path / "samples_rm_pairs.jsonl").read_text().splitlines()[0])
    assert sample["arguments"] == [[PAIRS[0]["prompt"], PAIRS[0]["chosen"]],
                                   [PAIRS[0]["prompt"], PAIRS[0]["rejected"]]]  # fmt: skip
    # A reward model answers reward tasks only; --num-fewshot is refused for them.
    assert main([*argv[:1], "boolq", *argv[2:]]) == 2
    assert "is a reward model" in capsys.readouterr().err
    assert main([*argv, "--num-fewshot", "2"]) == 2
    assert "--num-fewshot 2" in capsys.readouterr().err


def test_served_reward_route_and_evaluator_service(setup, tmp_path, capsys):
    root, rm, data, expected = setup
    config = InferenceServiceConfig(load=rm)
    inference = ServerThread(inference_bindings(config, load_engine(config)))
    evaluator = ServerThread(
        bindings(EvaluatorServiceConfig(data_roots=(root, tmp_path)), OperationsStore(None))
    )
    try:
        argv = ["--tasks", "rm_pairs", "--task-data-path", str(data), "--endpoint",
                inference.address, "--output-path", str(tmp_path / "cli"), "--no-progress",
                "--batch-size", "3"]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
        document = json.loads((tmp_path / "cli" / "results.json").read_text())
        _check(document["results"]["rm_pairs"], expected)
        channel = grpc.insecure_channel(evaluator.address)
        stub = evaluator_pb2_grpc.EvaluatorServiceStub(channel)
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        for model in (
            {"endpoint": inference.address},
            {
                "local": evaluator_pb2.LocalModel(
                    load_dir=str(rm), load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF
                )
            },
        ):
            out = tmp_path / ("served" if "endpoint" in model else "local")
            request = evaluator_pb2.StartEvaluationRequest(
                tasks=["rm_pairs"], task_data_path=str(data), output_path=str(out), **model
            )
            started = stub.StartEvaluation(request).operation
            done = ops.WaitOperation(
                operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=120)
            ).operation
            assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message
            document = json.loads((out / "results.json").read_text())
            _check(document["results"]["rm_pairs"], expected)
        channel.close()
    finally:
        evaluator.stop()
        inference.stop()


def test_causal_lm_is_refused_for_reward_tasks(
    setup, tmp_path, tmp_path_factory, sentencepiece_model, capsys
):
    from tests.services.inference.http_served import make_checkpoint

    _, _, data, _ = setup
    causal, _, _ = make_checkpoint(tmp_path_factory, sentencepiece_model)
    argv = ["--tasks", "rm_pairs", "--task-data-path", str(data), "--output-path",
            str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert main([*argv, "--load", str(causal)]) == 2
    assert "is a causal LM, not a reward model" in capsys.readouterr().err
    config = InferenceServiceConfig(load=causal, load_format="hf")
    inference = ServerThread(inference_bindings(config, load_engine(config)))
    try:
        assert main([*argv, "--endpoint", inference.address]) == 2
        assert "is a causal LM, not a reward model" in capsys.readouterr().err
    finally:
        inference.stop()


def test_bad_pair_records_name_the_line(tmp_path, capsys):
    from services.evaluator.tasks import get_task

    task = get_task("rm_pairs")
    for record, message in (
        ({"prompt": "p", "chosen": "a"}, "'rejected' must be a string"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "chosen equals rejected"),
        ({"prompt": "p", "chosen": "", "rejected": "a"}, "an empty response"),
        ({"prompt": "p" * 100_001, "chosen": "a", "rejected": "b"}, "'prompt' has 100001 char"),
    ):
        (tmp_path / "rm_pairs.jsonl").write_text(json.dumps(record) + "\n")
        with pytest.raises(ValueError, match=rf"rm_pairs.jsonl:1: .*{message}"):
            task.load(tmp_path)


@pytest.mark.slow
def test_trained_reward_model_served_and_evaluated_as_transformers_scores_its_export(
    sentencepiece_model, tmp_path
):
    """A reward model trained with `meshline train --stage rm` (native checkpoint), served and
    evaluated: the Reward RPC equals transformers on the HF export for the very ids `meshline
    preprocess` wrote for held-out pairs, and rm_pairs on the raw records (the evaluator's own
    encoding) gives transformers' accuracy on those ids, >= 0.9."""
    from transformers import AutoModelForSequenceClassification

    from meshline.inference.v1 import inference_pb2 as pb
    from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
    from services.preprocess.job import PreprocessConfig, run_preprocess
    from tests.training.test_alignment_effect import COLOURS, _reward_run
    from tokendata.datasets.pairwise import PairSource

    _, exported, _ = _reward_run(tmp_path, sentencepiece_model, "12")
    # Held-out pairs (prompts the run never saw), preprocessed whole (no side is cut).
    records = [
        {
            "prompt": f"Question {i}: name a colour.",
            "chosen": f" The colour is {COLOURS[i % len(COLOURS)]}.",
            "rejected": " No, I will not.",
        }
        for i in range(400, 440)
    ]
    held_out_path = tmp_path / "held_out.jsonl"
    held_out_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_preprocess(
        PreprocessConfig(
            input=(str(held_out_path),),
            output_prefix=str(tmp_path / "held_out"),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(sentencepiece_model),
            handler_name="preference",
            seq_length=128,
        )
    )
    held_out = PairSource(str(tmp_path / "held_out"))
    rows = [
        held_out.pair(i)[f"{side}_input_ids"].tolist()
        for i in range(len(held_out))
        for side in ("chosen", "rejected")
    ]
    hf = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    with torch.no_grad():
        theirs = [float(hf(input_ids=torch.tensor([row])).logits[0, 0]) for row in rows]
    right = sum(theirs[2 * i] > theirs[2 * i + 1] for i in range(len(held_out)))
    assert right >= 0.9 * len(held_out)

    config = InferenceServiceConfig(load=tmp_path / "rm", tokenizer=sentencepiece_model)
    inference = ServerThread(inference_bindings(config, load_engine(config)))
    try:
        stub = pb_grpc.InferenceServiceStub(grpc.insecure_channel(inference.address))
        reply = stub.Reward(pb.RewardRequest(inputs=[pb.RewardInput(token_ids=r) for r in rows]))
        assert max(abs(a - b) for a, b in zip(reply.rewards, theirs, strict=True)) <= 1e-5
    finally:
        inference.stop()
    argv = ["--tasks", "rm_pairs", "--task-data-path", str(held_out_path),
            "--load", str(tmp_path / "rm"), "--tokenizer", str(sentencepiece_model),
            "--output-path", str(tmp_path / "eval"), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    assert results["rm_pairs"]["acc,none"] == pytest.approx(right / len(held_out), abs=1e-9)
    margins = [theirs[2 * i] - theirs[2 * i + 1] for i in range(len(held_out))]
    assert results["rm_pairs"]["margin,none"] == pytest.approx(
        sum(margins) / len(margins), abs=1e-4
    )
