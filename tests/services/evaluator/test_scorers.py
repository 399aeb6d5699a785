"""Every task's scorer on known-right and known-wrong answers, read from the official formats.

The fixtures in tests/fixtures/evaluator are written in each benchmark's published layout;
right answers must score 1 on every metric and wrong ones 0, and malformed files must fail with
a message naming the file and what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.evaluator.tasks import get_task, groups, list_tasks, resolve
from tests.services.evaluator.lm_eval_ref import FIXTURES

MULTIPLE_CHOICE = ["boolq", "mmlu_anatomy", "mmlu_astronomy", "ceval-valid_accountant",
                   "agieval_lsat_ar", "agieval_logiqa_zh"]  # fmt: skip


def right_and_wrong_choice_answers(task, doc):
    gold = task.doc_to_target(doc)
    gold = gold[0] if isinstance(gold, list) else gold
    n = len(task.doc_to_choice(doc))
    right = [(-1.0 if i == gold else -9.0, i == gold) for i in range(n)]
    wrong_index = (gold + 1) % n
    wrong = [(-1.0 if i == wrong_index else -9.0, i == wrong_index) for i in range(n)]
    return right, wrong


@pytest.mark.parametrize("name", MULTIPLE_CHOICE)
def test_multiple_choice_right_and_wrong(name):
    task = get_task(name)
    docs, _ = task.load(FIXTURES)
    assert docs
    for doc in docs:
        right, wrong = right_and_wrong_choice_answers(task, doc)
        assert set(task.process(doc, right).values()) == {1.0}
        assert set(task.process(doc, wrong).values()) == {0.0}


def test_agieval_official_format_becomes_the_zero_shot_query():
    task = get_task("agieval_logiqa_zh")
    docs, _ = task.load(FIXTURES)
    assert docs[0]["query"].startswith(
        "问题：所有的鸟都会飞。企鹅是鸟。以下哪项一定为真？ 从以下选项中选择：(A)企鹅会飞"
    )
    assert docs[0]["query"].endswith("答案：从A到D, 我们应选择")
    assert docs[1]["gold"] == [1]


def test_gsm8k_right_and_wrong():
    task = get_task("gsm8k_cot")
    docs, pool = task.load(FIXTURES)
    assert len(pool) == 8
    for doc in docs:
        gold = doc["answer"].split("####")[-1].strip()
        right = task.process(doc, [f" We compute it. The answer is {gold}."])
        assert right == {"exact_match,strict-match": 1.0, "exact_match,flexible-extract": 1.0}
        wrong = task.process(doc, [" We compute it. The answer is 123456."])
        assert wrong == {"exact_match,strict-match": 0.0, "exact_match,flexible-extract": 0.0}
        # No "The answer is": strict fails, flexible takes the last number.
        loose = task.process(doc, [f" so it is {gold}"])
        assert loose == {"exact_match,strict-match": 0.0, "exact_match,flexible-extract": 1.0}


def test_gsm8k_5shot_right_and_wrong():
    task = get_task("gsm8k")
    docs, pool = task.load(FIXTURES)
    assert len(pool) == 8 and all("####" in doc["answer"] for doc in pool)
    for doc in docs:
        gold = doc["answer"].split("####")[-1].strip()
        right = task.process(doc, [f" We compute it.\n#### {gold}"])
        assert right == {"exact_match,strict-match": 1.0, "exact_match,flexible-extract": 1.0}
        wrong = task.process(doc, [" We compute it.\n#### 123456"])
        assert wrong == {"exact_match,strict-match": 0.0, "exact_match,flexible-extract": 0.0}
        # No "####": strict fails, flexible takes the last number.
        loose = task.process(doc, [f" so it is {gold}"])
        assert loose == {"exact_match,strict-match": 0.0, "exact_match,flexible-extract": 1.0}


def test_gsm8k_needs_its_train_split(tmp_path: Path):
    (tmp_path / "test.jsonl").write_text((FIXTURES / "gsm8k" / "test.jsonl").read_text())
    with pytest.raises(ValueError, match=r"train split; put GSM8K's train.jsonl at .*train.jsonl"):
        get_task("gsm8k").load(tmp_path)
    # gsm8k_cot needs no train split, and a test file given directly finds train.jsonl beside it.
    assert get_task("gsm8k_cot").load(tmp_path)[0]
    docs, pool = get_task("gsm8k").load(FIXTURES / "gsm8k" / "test.jsonl")
    assert len(docs) == 3 and len(pool) == 8


@pytest.mark.parametrize("name", ["agieval_math", "agieval_gaokao_mathcloze"])
def test_agieval_cloze_right_and_wrong(name):
    task = get_task(name)
    docs, pool = task.load(FIXTURES)
    assert docs and pool == []
    assert task.generation().until == ("Q:",) and task.generation().max_gen_toks == 32
    for doc in docs:
        gold = doc["answer"]
        value = gold.strip("$")
        for right in (f" {gold}", f" $\\boxed{{{value}}}$ is the result", f" so x = {value}."):
            assert task.process(doc, [right]) == {"acc,none": 1.0}, right
        for wrong in (" 12345", " I do not know", " $\\boxed{-1}$"):
            assert task.process(doc, [wrong]) == {"acc,none": 0.0}, wrong


def test_math_answer_normalisation():
    from services.evaluator.scoring.math_answers import extract_answer, math_equivalent

    assert extract_answer("so $x = \\frac{1}{2}$ and then") == "\\frac{1}{2}"
    assert extract_answer("first \\boxed{3} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("no answer here") is None
    assert math_equivalent("$\\dfrac12$", "$0.5$") and math_equivalent("$3/4$", "$\\frac34$")
    assert math_equivalent("$30^{\\circ}$", "$30$") and math_equivalent("$\\sqrt3$", "$\\sqrt{3}$")
    assert not math_equivalent("$\\frac{1}{3}$", "$\\frac{1}{2}$")
    # As lm-eval: the gold is parsed too, so a bare-LaTeX fraction reduces to its last number.
    assert not math_equivalent("$\\frac{1}{2}$", "\\frac{1}{2}")
    assert math_equivalent("2", "\\frac{1}{2}")


def test_agieval_official_cloze_format_becomes_the_zero_shot_query(tmp_path: Path):
    docs, _ = get_task("agieval_gaokao_mathcloze").load(FIXTURES)
    assert docs[1] == {"query": "问题：函数 $y=x^2$ 在 $x=3$ 处的导数为\n答案：", "answer": "$6$"}
    (tmp_path / "math.jsonl").write_text(
        json.dumps({"passage": None, "question": "1+1?", "answer": "2"})
        + "\n"
        + json.dumps({"passage": None, "question": "2+2?", "answer": None})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"math.jsonl:2: record lacks 'answer'"):
        get_task("agieval_math").load(tmp_path)
    (tmp_path / "math.jsonl").write_text(json.dumps({"query": "Q: 1+1?\nA: The answer is"}))
    with pytest.raises(ValueError, match=r"math.jsonl:1: a 'query' record needs answer"):
        get_task("agieval_math").load(tmp_path)


def test_bbh_right_and_wrong():
    task = get_task("bbh_fewshot_boolean_expressions")
    docs, pool = task.load(FIXTURES)
    assert len(pool) == 3
    for doc in docs:
        assert task.process(doc, [doc["target"]]) == {"exact_match,none": 1.0}
        other = "True" if doc["target"] == "False" else "False"
        assert task.process(doc, [other]) == {"exact_match,none": 0.0}


def test_humaneval_reads_gzip_and_jsonl(tmp_path: Path):
    import gzip

    source = (FIXTURES / "humaneval" / "HumanEval.jsonl").read_bytes()
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(gzip.compress(source))
    docs, _ = get_task("humaneval").load(tmp_path)
    assert [d["task_id"] for d in docs] == ["HumanEval/0", "HumanEval/1"]


def test_registry_names_groups_and_unknowns():
    names = list_tasks()
    assert len([n for n in names if n.startswith("mmlu_")]) == 57
    assert len([n for n in names if n.startswith("ceval-valid_")]) == 52
    assert len([n for n in names if n.startswith("bbh_fewshot_")]) == 27
    assert {"boolq", "gsm8k", "gsm8k_cot", "humaneval"} <= set(names)
    assert {"agieval_math", "agieval_gaokao_mathcloze"} <= set(groups()["agieval"])
    assert len(groups()["agieval"]) == 21
    assert set(groups()["mmlu_stem"]) < set(groups()["mmlu"])
    assert [t.name for t in resolve(["mmlu_anatomy", "mmlu_anatomy"])] == ["mmlu_anatomy"]
    with pytest.raises(
        ValueError, match=r"unknown task name.*known tasks: agieval_aqua_rat"
    ) as err:
        resolve(["mmlu_no_such_subject"])
    for name in ("agieval_math", "agieval_gaokao_mathcloze", "gsm8k", "gsm8k_cot"):
        assert f" {name}," in str(err.value)


def test_bad_files_name_the_file_and_the_problem(tmp_path: Path):
    (tmp_path / "boolq").mkdir()
    (tmp_path / "boolq" / "dev.jsonl").write_text('{"question": "q", "passage": "p"}\n')
    with pytest.raises(ValueError, match=r"dev.jsonl:1.*answer"):
        get_task("boolq").load(tmp_path)
    (tmp_path / "test").mkdir()
    (tmp_path / "dev").mkdir()
    (tmp_path / "test" / "anatomy_test.csv").write_text("q,a,b,c,d,E\n")
    (tmp_path / "dev" / "anatomy_dev.csv").write_text("")
    with pytest.raises(ValueError, match=r"anatomy_test.csv:1: answer 'E'"):
        get_task("mmlu_anatomy").load(tmp_path)
    with pytest.raises(ValueError, match="no data for task gsm8k_cot"):
        get_task("gsm8k_cot").load(tmp_path)
    (tmp_path / "bbh").mkdir()
    (tmp_path / "bbh" / "navigate.json").write_text(json.dumps({"examples": [{"input": "x"}]}))
    with pytest.raises(ValueError, match="target"):
        get_task("bbh_fewshot_navigate").load(tmp_path)


def test_too_many_fewshot_examples_is_an_error():
    task = get_task("mmlu_anatomy")
    docs, pool = task.load(FIXTURES)
    with pytest.raises(ValueError, match=r"--num-fewshot 6.*only 5"):
        task.context(docs[0], pool, 6)


def test_cancelled_run_stops_before_asking_the_model(tmp_path: Path):
    from services.evaluator.runner import EvalConfig, evaluate

    class Unreachable:
        name = fingerprint = "unreachable"
        flag, is_reward_model = "--endpoint", None

        def loglikelihood(self, requests):
            raise AssertionError("a cancelled run must not send requests")

    config = EvalConfig(tasks=("boolq",), task_data_path=FIXTURES, output_path=tmp_path)
    with pytest.raises(InterruptedError):
        evaluate(config, Unreachable(), cancelled=lambda: True)
