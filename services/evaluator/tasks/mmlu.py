"""MMLU (Hendrycks et al., 2021): 57 subjects of 4-way multiple choice, 5-shot from `dev`.

Data: the published layout, headerless csv rows `question,A,B,C,D,answer` in
`dev/{subject}_dev.csv`, `val/{subject}_val.csv`, `test/{subject}_test.csv` (a `data/` parent is
accepted). Prompt as lm-eval's `mmlu_{subject}`: a subject description, the first k dev
questions with their answer letter, then "question\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:".
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from services.evaluator.tasks.base import Doc, MetricSpec, MissingData, open_task_file, task_file
from services.evaluator.tasks.catalog import catalog
from services.evaluator.tasks.multiple_choice import MultipleChoiceTask

LETTERS = ["A", "B", "C", "D"]


def read_choice_csv(path: Path, header: bool, subject: str) -> list[Doc]:
    """Rows of an MMLU (headerless) or C-Eval (with header) csv as question/choices/answer docs."""
    docs = []
    with open_task_file(path) as fh:
        reader = csv.reader(fh)
        if header:
            names = next(reader, [])
            required = {"question", "A", "B", "C", "D", "answer"}
            if not required <= set(names):
                raise ValueError(f"{path}: header {names} lacks {sorted(required - set(names))}")
        for number, row in enumerate(reader, 2 if header else 1):
            if header:
                record = dict(zip(names, row, strict=False))
                question, options, answer = (
                    record["question"],
                    [record[k] for k in LETTERS],
                    record["answer"],
                )
            else:
                if len(row) != 6:
                    raise ValueError(
                        f"{path}:{number}: expected 6 columns (question,A,B,C,D,answer), "
                        f"got {len(row)}"
                    )
                question, options, answer = row[0], row[1:5], row[5]
            if answer.strip() not in LETTERS:
                raise ValueError(f"{path}:{number}: answer {answer!r} is not one of A, B, C, D")
            docs.append(
                {
                    "question": question,
                    "subject": subject,
                    "choices": options,
                    "answer": LETTERS.index(answer.strip()),
                }
            )
    return docs


def split_file(data_path: Path, split: str, subject: str, task: str, family: str) -> Path:
    """`{split}/{subject}_{split}.csv` under `data_path`, `data/`, `{family}/` or `{family}/data`."""
    for root in (data_path, data_path / "data", data_path / family, data_path / family / "data"):
        path = root / split / f"{subject}_{split}.csv"
        if path.is_file():
            return task_file(path, data_path)
    raise MissingData(
        f"--task-data-path {data_path}: no data for task {task}; it needs "
        f"{split}/{subject}_{split}.csv"
    )


@dataclass
class MMLUSubject(MultipleChoiceTask):
    """One MMLU subject (test split, few-shot from dev)."""

    subject: str = ""
    default_num_fewshot: int = 5
    metrics: tuple[MetricSpec, ...] = field(default_factory=lambda: (MetricSpec("acc"),))

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """Test questions, and the dev questions as the few-shot pool."""
        test = split_file(data_path, "test", self.subject, self.name, "mmlu")
        dev = split_file(data_path, "dev", self.subject, self.name, "mmlu")
        return (
            read_choice_csv(test, False, self.subject),
            read_choice_csv(dev, False, self.subject),
        )

    def doc_to_text(self, doc: Doc) -> str:
        """Question, lettered options and the answer cue."""
        c = doc["choices"]
        return f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"

    def doc_to_choice(self, doc: Doc) -> list[str]:
        """The answer letters."""
        return LETTERS

    def doc_to_target(self, doc: Doc) -> int:
        """Index of the right letter."""
        return int(doc["answer"])


def tasks() -> list[MMLUSubject]:
    """One task per subject, in the group "mmlu" with its category as subgroup."""
    return [
        MMLUSubject(
            name=f"mmlu_{subject}",
            subject=subject,
            summary=f"MMLU {subject.replace('_', ' ')} ({category})",
            group="mmlu",
            subgroup=f"mmlu_{category}",
            description="The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n",
        )
        for subject, category in catalog()["mmlu"].items()
    ]
