"""Reward functions by name: verifiable scorers equal to the evaluator's, and a `--stage rm`
checkpoint scoring completions in process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.evaluator.scoring.filters import RegexFilter
from services.evaluator.scoring.metrics import exact_match as evaluator_exact_match
from services.evaluator.tasks.gsm8k import LAST_NUMBER, REGEXES_TO_IGNORE
from training.objectives.rollouts import Sample
from training.rewards import build_reward, gsm8k_answer, load_reward_model

GSM8K_COMPLETIONS = [
    "She pays 3 * 4 = 12 dollars.\n#### 12",
    "The total is $1,250.",
    "So the answer is 7.",
    "Half of 18 is 9, minus 2 is 7, so 42",
    "no number here",
    "#### -3",
    "It costs 12.50 dollars",
]


def _sample(text: str, answer: str, ids=(5, 6)) -> Sample:
    return Sample([1, 2, 3], SimpleNamespace(token_ids=list(ids), text=text), {"answer": answer})


def _evaluator_gsm8k(text: str, gold: str) -> float:
    """The evaluator's GSM8K: strict "#### n", else the flexible last number; exact_match."""
    strict = RegexFilter(r"#### (\-?[0-9\.\,]+)")(text)
    answer = strict if strict != "[invalid]" else LAST_NUMBER(text)
    return evaluator_exact_match(answer, gold, regexes_to_ignore=REGEXES_TO_IGNORE)


@pytest.mark.parametrize("gold", ["12", "1250", "7", "42", "-3", "12.50", "#### 7"])
def test_gsm8k_reward_equals_the_evaluators_answer_match(gold) -> None:
    reward = build_reward(["gsm8k"])
    samples = [_sample(text, gold) for text in GSM8K_COMPLETIONS]
    expected = [_evaluator_gsm8k(text, gold) for text in GSM8K_COMPLETIONS]
    assert reward(samples).tolist() == expected


def test_gsm8k_answer_extraction() -> None:
    assert gsm8k_answer("x\n#### 1,000") == "1000"
    assert gsm8k_answer("it is 3 then 4.") == "4"
    assert gsm8k_answer("none") is None


def test_exact_match_regex_and_weights_combine() -> None:
    samples = [_sample(" 7 ", "7"), _sample("7 apples", "7"), _sample("eight", "7")]
    assert build_reward(["exact_match"])(samples).tolist() == [1.0, 0.0, 0.0]
    assert build_reward(["regex"], regex=r"^\s*\d")(samples).tolist() == [1.0, 1.0, 0.0]
    combined = build_reward(["exact_match", "regex"], [2.0, 0.5], regex=r"apples")
    assert combined(samples).tolist() == [2.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"names": []}, "--reward-funcs"),
        ({"names": ["bleu"]}, "--reward-funcs"),
        ({"names": ["gsm8k", "gsm8k"]}, "twice"),
        ({"names": ["regex"]}, "--reward-regex"),
        ({"names": ["regex"], "regex": "("}, "not a regular expression"),
        ({"names": ["gsm8k"], "regex": "x"}, "--reward-regex applies"),
        ({"names": ["gsm8k", "exact_match"], "weights": [1.0]}, "--reward-weights"),
        ({"names": ["reward_model"]}, "--reward-model"),
    ],
)
def test_reward_settings_are_refused_by_name(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_reward(**kwargs)


def test_a_stage_rm_checkpoint_scores_completions_in_process(sentencepiece_model, tmp_path):
    from services.preprocess.job import PreprocessConfig, run_preprocess
    from services.trainer.arguments import parse_args
    from tests.fixtures import records as fx
    from training.loop import Trainer

    records = [
        {"prompt": f"Q{i}: say yes.", "chosen": " yes yes", "rejected": " no no"} for i in range(16)
    ]
    path = fx.write_jsonl(tmp_path / "pairs.jsonl", records)
    prefix = tmp_path / "pairs"
    run_preprocess(
        PreprocessConfig(
            input=(str(path),),
            output_prefix=str(prefix),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(sentencepiece_model),
            handler_name="preference",
            seq_length=16,
        )
    )
    save = tmp_path / "rm"
    flags = [
        "--model", "tiny-llama", "--stage", "rm", "--data-path", str(prefix), "--split", "100,0,0",
        "--tokenizer-type", "SentencePiece", "--tokenizer-model", str(sentencepiece_model),
        "--seq-length", "16", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--train-iters", "2", "--lr", "1e-3", "--eval-interval", "0", "--seed", "3",
        "--save", str(save),
    ]  # fmt: skip
    trainer = Trainer(parse_args(flags))
    trainer.fit()
    model = load_reward_model(save)
    samples = [_sample("", "", ids=(7, 8, 9)), _sample("", "", ids=(20,))]
    reward = build_reward(["reward_model"], reward_model=lambda: model)(samples)
    trained = trainer.model.eval()
    with torch.no_grad():
        direct = [
            float(trained(torch.tensor([[1, 2, 3, 7, 8, 9]]))[0, -1, 0]),
            float(trained(torch.tensor([[1, 2, 3, 20]]))[0, -1, 0]),
        ]
    assert reward.tolist() == pytest.approx(direct, abs=1e-6)
    assert reward[0] != reward[1]
    with pytest.raises(ValueError, match="--reward-model"):
        load_reward_model(tmp_path)  # not a checkpoint directory
