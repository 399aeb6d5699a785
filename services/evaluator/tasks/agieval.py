"""AGIEval (Zhong et al., 2023): admission-exam questions in English and Chinese, zero-shot.

Data: one jsonl per subtask named as published (`lsat-ar.jsonl`, `logiqa-zh.jsonl`, `math.jsonl`,
...), either lm-eval's processed records (`query` plus `choices`/`gold` = list of right indices
for multiple choice, or `answer` for cloze) or AGIEval's own v1 records (`passage`, `question`,
and `options` "(A)..." with `label` "A" or ["A", "C"], or `answer` for cloze), which are turned
into the zero-shot query of AGIEval's loader.

As lm-eval's `agieval_*`: the 19 multiple-choice subtasks score acc and acc_norm by
log-likelihood of the options, right when the arg-max is any gold answer; the two cloze subtasks
(`math`, `gaokao-mathcloze`) generate up to 32 tokens until "Q:" and score acc by math-answer
equivalence (`services.evaluator.scoring.math_answers`). The subtask list, language and format
of each come from the catalog.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.evaluator.scoring.math_answers import math_equivalent
from services.evaluator.tasks.base import (
    GENERATE_UNTIL,
    Doc,
    GenerationSpec,
    MetricSpec,
    Task,
    find_file,
    read_jsonl,
)
from services.evaluator.tasks.catalog import catalog
from services.evaluator.tasks.multiple_choice import MultipleChoiceTask

LETTERS = "ABCDEFGHIJ"


def official_to_query(record: Doc, chinese: bool, where: str) -> Doc:
    """An AGIEval v1 multiple-choice record as query/choices/gold (the zero-shot prompt)."""
    for key in ("question", "options", "label"):
        if key not in record:
            raise ValueError(f"{where}: record lacks {key!r} (and has no 'query'/'choices'/'gold')")
    options = list(record["options"])
    passage = record.get("passage") or ""
    last = LETTERS[len(options) - 1]
    if chinese:
        query = (
            f"问题：{passage}{record['question']} 从以下选项中选择：{' '.join(options)}\n"
            f"答案：从A到{last}, 我们应选择"
        )
    else:
        query = (
            f"Q: {passage}{record['question']} Answer Choices: {' '.join(options)}\n"
            f"A: Among A through {last}, the answer is"
        )
    labels = record["label"] if isinstance(record["label"], list) else [record["label"]]
    return {"query": query, "choices": options, "gold": [LETTERS.index(x) for x in labels]}


def official_to_cloze(record: Doc, chinese: bool, where: str) -> Doc:
    """An AGIEval v1 cloze record as query/answer (the zero-shot prompt)."""
    for key in ("question", "answer"):
        if not record.get(key):
            raise ValueError(f"{where}: record lacks {key!r} (and has no 'query')")
    passage = record.get("passage") or ""
    if chinese:
        query = f"问题：{passage}{record['question']}\n答案："
    else:
        query = f"Q: {passage}{record['question']}\nA: The answer is"
    return {"query": query, "answer": str(record["answer"])}


Converter = Callable[[Doc, bool, str], Doc]


def read_subtask(
    data_path: Path, task: AGIEvalSubtask | AGIEvalCloze, needs: tuple[str, ...], convert: Converter
) -> list[Doc]:
    """Docs of `task`'s jsonl: `query` records need `needs`; others go through `convert`."""
    dataset, chinese = task.dataset, task.chinese
    path = find_file(data_path, [f"{dataset}.jsonl", f"*/{dataset}.jsonl"], task.name, "agieval")
    docs = []
    for number, record in enumerate(read_jsonl(path), 1):
        if "query" in record:
            if not set(needs) <= set(record):
                raise ValueError(f"{path}:{number}: a 'query' record needs {' and '.join(needs)}")
            docs.append(record)
        else:
            docs.append(convert(record, chinese, f"{path}:{number}"))
    return docs


@dataclass
class AGIEvalSubtask(MultipleChoiceTask):
    """One AGIEval multiple-choice subtask (zero-shot)."""

    dataset: str = ""
    chinese: bool = False

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """The subtask's jsonl; AGIEval has no few-shot split here (zero-shot only)."""
        return read_subtask(data_path, self, ("choices", "gold"), official_to_query), []

    def doc_to_text(self, doc: Doc) -> str:
        """The prepared query."""
        return str(doc["query"])

    def doc_to_choice(self, doc: Doc) -> list[str]:
        """The options as written ("(A)...")."""
        return list(doc["choices"])

    def doc_to_target(self, doc: Doc) -> list[int]:
        """Indices of every right option."""
        return [int(g) for g in doc["gold"]]


@dataclass
class AGIEvalCloze(Task):
    """One AGIEval fill-in-the-blank math subtask (zero-shot generation, acc by equivalence)."""

    dataset: str = ""
    chinese: bool = False
    metrics: tuple[MetricSpec, ...] = field(default_factory=lambda: (MetricSpec("acc"),))
    output_type: str = GENERATE_UNTIL

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """The subtask's jsonl (zero-shot only)."""
        return read_subtask(data_path, self, ("answer",), official_to_cloze), []

    def doc_to_text(self, doc: Doc) -> str:
        """The prepared query."""
        return str(doc["query"])

    def doc_to_target(self, doc: Doc) -> str:
        """The reference answer as written (LaTeX allowed)."""
        return str(doc["answer"])

    def generation(self) -> GenerationSpec:
        """Greedy, until "Q:", at most 32 tokens (lm-eval's generation_kwargs)."""
        return GenerationSpec(("Q:",), 32)

    def process(self, doc: Doc, answers: Any) -> dict[str, float]:
        """acc: the first generation's answer is equivalent to the reference."""
        return {"acc,none": float(math_equivalent(answers[0], self.doc_to_target(doc)))}


def tasks() -> list[Task]:
    """The 21 subtasks of the group "agieval" (19 multiple choice, 2 cloze)."""
    found: list[Task] = []
    for dataset, entry in catalog()["agieval"].items():
        cloze = entry["format"] == "cloze"
        kind = AGIEvalCloze if cloze else AGIEvalSubtask
        found.append(
            kind(
                name=f"agieval_{dataset.replace('-', '_')}",
                dataset=dataset,
                chinese=entry["language"] == "zh",
                summary=f"AGIEval {dataset} ({'cloze, generation' if cloze else 'multiple choice'})",
                group="agieval",
            )
        )
    return found
