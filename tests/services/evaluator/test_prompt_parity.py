"""Meshline's prompts and per-sample scores equal lm-evaluation-harness's for the same records.

For each benchmark, one subtask is built both ways over the fixture records: Meshline's task
reading the published file format, lm-eval's own ConfigurableTask (from its bundled YAML) over
the same records in the Hugging Face shape. The request arguments (context, continuation /
stop strings) must be identical strings, and `process_results` must agree with ours on the same
model answers.
"""

from __future__ import annotations

import json
import random

import pytest

from services.evaluator.runner import EvalConfig, prepare_task
from services.evaluator.tasks import get_task
from services.evaluator.tasks.mmlu import LETTERS
from tests.services.evaluator.lm_eval_ref import FIXTURES, reference_requests, reference_task

pytest.importorskip("lm_eval")


def ours(task_name: str, num_fewshot: int):
    """Meshline's prepared requests (per doc: list of (key, arguments)) and the task."""
    task = get_task(task_name)
    config = EvalConfig(
        tasks=(task_name,), task_data_path=FIXTURES, output_path=FIXTURES, num_fewshot=num_fewshot
    )
    return prepare_task(task, config)


def assert_mc_equal(prepared, reference):
    assert len(prepared.requests) == len(reference)
    for mine, theirs in zip(prepared.requests, reference, strict=True):
        assert [tuple(args) for _, args in mine] == [tuple(a) for a in theirs]


def assert_mc_scores_equal(prepared, lm_task, seed=0):
    """process_results of lm-eval == ours for random log-likelihoods (ties excluded)."""
    rng = random.Random(seed)
    reference_docs = list(lm_task.eval_docs)
    for doc, ref_doc in zip(prepared.docs, reference_docs, strict=True):
        for _ in range(5):
            choices = prepared.task.doc_to_choice(doc)
            answers = [(rng.uniform(-20, -1), rng.random() < 0.5) for _ in choices]
            mine = prepared.task.process(doc, answers)
            theirs = lm_task.process_results(ref_doc, answers)
            for key, value in mine.items():
                assert theirs[key.split(",")[0]] == value, key


def mmlu_rows(path, subject):
    return [
        {
            "question": d["question"],
            "subject": subject,
            "choices": d["choices"],
            "answer": d["answer"],
        }
        for d in _csv_docs(path, subject)
    ]


def _csv_docs(path, subject):
    from services.evaluator.tasks.mmlu import read_choice_csv

    return read_choice_csv(path, False, subject)


def test_mmlu_5shot_prompts_and_scores():
    prepared = ours("mmlu_anatomy", 5)
    lm_task = reference_task(
        "mmlu/default/mmlu_anatomy.yaml",
        {
            "test": mmlu_rows(FIXTURES / "mmlu/test/anatomy_test.csv", "anatomy"),
            "dev": mmlu_rows(FIXTURES / "mmlu/dev/anatomy_dev.csv", "anatomy"),
        },
    )
    assert_mc_equal(prepared, reference_requests(lm_task, 5))
    assert_mc_scores_equal(prepared, lm_task)


def test_ceval_5shot_prompts_and_scores():
    import csv

    def rows(path):
        with open(path, encoding="utf-8", newline="") as fh:
            records = list(csv.DictReader(fh))
        for r in records:
            r.setdefault("explanation", "")
            r["id"] = int(r["id"])
        return records

    prepared = ours("ceval-valid_accountant", 5)
    lm_task = reference_task(
        "ceval/ceval-valid_accountant.yaml",
        {
            "val": rows(FIXTURES / "ceval/val/accountant_val.csv"),
            "dev": rows(FIXTURES / "ceval/dev/accountant_dev.csv"),
        },
    )
    assert_mc_equal(prepared, reference_requests(lm_task, 5))
    assert_mc_scores_equal(prepared, lm_task)


@pytest.mark.parametrize("num_fewshot", [0, 2])
def test_boolq_prompts_and_scores(num_fewshot):
    def rows(path):
        return [
            {
                "question": r["question"],
                "passage": r["passage"],
                "idx": i,
                "label": int(r["answer"]),
            }
            for i, r in enumerate(map(json.loads, path.read_text().splitlines()))
        ]

    prepared = ours("boolq", num_fewshot)
    lm_task = reference_task(
        "super_glue/boolq/default.yaml",
        {
            "validation": rows(FIXTURES / "boolq/dev.jsonl"),
            "train": rows(FIXTURES / "boolq/train.jsonl"),
        },
    )
    assert_mc_equal(prepared, reference_requests(lm_task, num_fewshot))
    assert_mc_scores_equal(prepared, lm_task)


def test_agieval_prompts_and_multi_gold_scores():
    records = [
        json.loads(line) for line in (FIXTURES / "agieval/lsat-ar.jsonl").read_text().splitlines()
    ]
    prepared = ours("agieval_lsat_ar", 0)
    lm_task = reference_task("agieval/lsat-ar.yaml", {"test": records})
    assert_mc_equal(prepared, reference_requests(lm_task, 0))
    assert_mc_scores_equal(prepared, lm_task)
    # A record with two right answers: lm-eval counts either as right; so do we.
    doc = {**records[0], "gold": [1, 3]}
    answers = [(-5.0, False), (-4.0, False), (-9.0, False), (-1.0, True), (-8.0, False)]
    mine = prepared.task.process(doc, answers)
    theirs = lm_task.process_results(doc, answers)
    assert (
        mine
        == {"acc,none": theirs["acc"], "acc_norm,none": theirs["acc_norm"]}
        == {
            "acc,none": 1.0,
            "acc_norm,none": 1.0,
        }
    )


def assert_generation_equal(prepared, reference, max_gen_toks=None):
    for mine, theirs in zip(prepared.requests, reference, strict=True):
        (_, (context, kwargs)), (ref_context, ref_kwargs) = mine[0], theirs[0]
        assert context == ref_context
        assert kwargs["until"] == ref_kwargs["until"]
        if max_gen_toks is not None:
            assert kwargs["max_gen_toks"] == ref_kwargs.get("max_gen_toks", 256) == max_gen_toks


def test_gsm8k_cot_8shot_prompts_filters_and_scores():
    from lm_eval.filters.extraction import RegexFilter

    records = [
        json.loads(line) for line in (FIXTURES / "gsm8k/test.jsonl").read_text().splitlines()
    ]
    prepared = ours("gsm8k_cot", 8)
    lm_task = reference_task("gsm8k/gsm8k-cot.yaml", {"test": records})
    assert_generation_equal(prepared, reference_requests(lm_task, 8), max_gen_toks=256)
    responses = [
        " Tom has 3 + 4 = 7 apples. The answer is 7.",
        " The price is 12 - 3 = $9. The answer is $9.",
        " So 1,200 - 200 = 1,000 chickens. The answer is 1,000.",
        " I am not sure, maybe 12 or 13",
        " The answer is -4.5.",
    ]
    lm_filters = {
        "strict-match": RegexFilter(r"The answer is (\-?[0-9\.\,]+)."),
        "flexible-extract": RegexFilter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1),
    }
    task = prepared.task
    for doc in prepared.docs:
        for response in responses:
            mine = task.process(doc, [response])
            for name, lm_filter in lm_filters.items():
                filtered = lm_filter.apply([[response]], [doc])[0][0]
                assert task.filters[name](response) == filtered
                theirs = lm_task.process_results(doc, [filtered])["exact_match"]
                assert mine[f"exact_match,{name}"] == theirs, (name, response)


def test_bbh_3shot_prompts_and_scores():
    records = json.loads((FIXTURES / "bbh/boolean_expressions.json").read_text())["examples"]
    prepared = ours("bbh_fewshot_boolean_expressions", 3)
    lm_task = reference_task("bbh/fewshot/boolean_expressions.yaml", {"test": records})
    assert_generation_equal(prepared, reference_requests(lm_task, 3), max_gen_toks=256)
    for doc in prepared.docs:
        for response in (
            doc["target"],
            " " + doc["target"],
            "True" if doc["target"] == "False" else "False",
        ):
            mine = prepared.task.process(doc, [response])
            theirs = lm_task.process_results(doc, [response])["exact_match"]
            assert mine["exact_match,none"] == theirs


def test_humaneval_prompts():
    records = [
        json.loads(line)
        for line in (FIXTURES / "humaneval/HumanEval.jsonl").read_text().splitlines()
    ]
    prepared = ours("humaneval", 0)
    lm_task = reference_task(
        "humaneval/humaneval.yaml",
        {"test": records},
        _resolve_functions=False,
        metric_list=[{"metric": "exact_match"}],
        filter_list=None,
    )
    assert_generation_equal(prepared, reference_requests(lm_task, 0), max_gen_toks=1024)
    for doc in prepared.docs:
        assert prepared.task.doc_to_target(doc) == lm_task.doc_to_target(doc)


def test_letters_match_lm_eval_choices():
    assert LETTERS == ["A", "B", "C", "D"]


def test_gsm8k_5shot_prompts_filters_and_scores():
    from lm_eval.filters.extraction import RegexFilter

    def rows(name):
        return [json.loads(line) for line in (FIXTURES / "gsm8k" / name).read_text().splitlines()]

    prepared = ours("gsm8k", 5)
    lm_task = reference_task(
        "gsm8k/gsm8k.yaml", {"test": rows("test.jsonl"), "train": rows("train.jsonl")}
    )
    reference = reference_requests(lm_task, 5)
    assert_generation_equal(prepared, reference, max_gen_toks=256)
    # The seeded sampler gives different documents different examples, as lm-eval's does.
    assert len({mine[0][1][0].split("\n\n")[0] for mine in prepared.requests}) > 1
    responses = [
        " Tom has 3 + 4 = 7 apples.\n#### 7",
        " 12 - 3 = 9 dollars.\n#### $9",
        " 1,200 - 200 = 1,000 chickens.\n#### 1,000",
        " I am not sure, maybe 12 or 13",
        " The answer is 7.",
        " #### -4.5",
    ]
    lm_filters = {
        "strict-match": RegexFilter(r"#### (\-?[0-9\.\,]+)"),
        "flexible-extract": RegexFilter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1),
    }
    task = prepared.task
    seen = set()
    for doc in prepared.docs:
        for response in responses:
            mine = task.process(doc, [response])
            for name, lm_filter in lm_filters.items():
                filtered = lm_filter.apply([[response]], [doc])[0][0]
                assert task.filters[name](response) == filtered
                theirs = lm_task.process_results(doc, [filtered])["exact_match"]
                assert mine[f"exact_match,{name}"] == theirs, (name, response)
                seen.add(theirs)
    assert seen == {0, 1}


@pytest.mark.parametrize(
    ("name", "yaml"),
    [("agieval_math", "math"), ("agieval_gaokao_mathcloze", "gaokao-mathcloze")],
)
def test_agieval_cloze_prompts_and_scores(name, yaml):
    # math.jsonl holds lm-eval's processed records; gaokao-mathcloze.jsonl AGIEval's own v1
    # records, which lm-eval reads as the queries we build from them.
    prepared = ours(name, 0)
    lm_task = reference_task(f"agieval/{yaml}.yaml", {"test": prepared.docs})
    assert_generation_equal(prepared, reference_requests(lm_task, 0), max_gen_toks=32)
    for doc in prepared.docs:
        assert prepared.task.doc_to_target(doc) == lm_task.doc_to_target(doc)
        for response in (
            f" {doc['answer']}",
            f" $\\boxed{{{doc['answer']}}}$",
            f" x = {doc['answer']}.",
            " 12345",
            " \\boxed{}",
        ):
            mine = prepared.task.process(doc, [response])
            assert mine == {"acc,none": lm_task.process_results(doc, [response])["acc"]}


def test_math_answer_equivalence_matches_lm_eval_on_random_answers():
    """lm-eval's agieval `is_equiv` (via process_results) vs ours on generated answer pairs:
    spellings of the same value in different wrappers, and random LaTeX-ish strings."""
    from services.evaluator.scoring import math_answers

    lm_task = reference_task("agieval/math.yaml", {"test": [{"query": "Q", "answer": "1"}]})
    spellings = [
        ["\\frac{1}{2}", "\\frac12", "1/2", "0.5", "\\dfrac{1}{2}", "\\tfrac12", ".5"],
        ["\\frac{3}{4}", "3/4", "\\frac34", "\\frac3{4}", "\\dfrac34"],
        ["\\sqrt{3}", "\\sqrt3", "\\sqrt 3"],
        ["\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", "\\dfrac{\\sqrt{3}}2"],
        ["30^\\circ", "30^{\\circ}", "30"],
        ["5\\%", "5", "5\\!"],
        ["3\\text{ cm}", "3", "3\\text{ cm}\\text{ m}"],
        ["\\left(1,2\\right)", "(1,2)", "(1, 2)"],
        ["x=4", "4", "x = 4", "4.0"],
        ["\\frac", "\\sqrt", "", "{.5}"],
    ]
    wrappers = [
        "{}", "${}$", "\\boxed{{{}}}", "The answer is ${}$.", "so y = {}", "$x = {}$", "{}.",
        "\\boxed{{a = {}}}", "{}\\n then 7",
    ]  # fmt: skip
    pieces = [
        "\\boxed{", "}", "{", "$", "=", " ", "\\frac", "12", "1", "2", "3", "0.5", ".5", "/",
        "\\sqrt", "\\text{ cm}", "\\text{ ", "\\left(", "\\right)", "^\\circ", "^{\\circ}",
        "\\%", "\\$", "\\!", "\\\\", "dfrac", "tfrac", "x", "\\n", "\n", ".", "-",
        "The answer is ", "k = ", "\\fbox{", "a", "7.25",
    ]  # fmt: skip
    rng = random.Random(0)

    def spelled(values: list[str]) -> str:
        return rng.choice(wrappers).format(rng.choice(values))

    def random_text() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))

    outcomes, fallbacks = [], 0
    for i in range(4000):
        if i % 2:
            values = rng.choice(spellings)
            gold = spelled(values)
            response = spelled(values if rng.random() < 0.8 else rng.choice(spellings))
        else:
            gold, response = random_text(), random_text()
        theirs = lm_task.process_results({"answer": gold}, [response])["acc"]
        mine = math_answers.math_equivalent(response, gold)
        assert float(mine) == theirs, (response, gold)
        outcomes.append(mine and response != gold)
        try:
            math_answers.normalize(math_answers.extract_answer(response))
        except math_answers.NotNormalizable:
            fallbacks += 1
    # Many pairs are equal only after normalising; many fall back to comparing the raw answers.
    assert sum(outcomes) > 500 and fallbacks > 100
