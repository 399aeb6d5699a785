"""BoolQ (Clark et al., 2019): yes/no questions about a passage, scored by log-likelihood.

Data: the published `dev.jsonl` (fields `question`, `passage`, `answer` true/false; SuperGLUE's
`label` 0/1 is accepted too) and, for few-shot prompts, `train.jsonl`. Prompt as lm-eval's
`boolq`: "{passage}\\nQuestion: {question}?\\nAnswer:" with choices " no" / " yes".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.evaluator.tasks.base import (
    Doc,
    MetricSpec,
    find_file,
    read_jsonl,
    require_fields,
    task_file,
)
from services.evaluator.tasks.multiple_choice import MultipleChoiceTask


@dataclass
class BoolQ(MultipleChoiceTask):
    """BoolQ validation split, acc."""

    name: str = "boolq"
    version: str = "2.0"
    sampler: str = "random"
    exclude_eval_doc: bool = True
    metrics: tuple[MetricSpec, ...] = field(default_factory=lambda: (MetricSpec("acc"),))

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """dev.jsonl (or val/validation) to evaluate, train.jsonl as the few-shot pool."""
        path = find_file(
            data_path,
            ["dev.jsonl", "val.jsonl", "validation.jsonl"],
            self.name,
            "boolq",
        )
        docs = [self._normalize(d, f"{path}:{i + 1}") for i, d in enumerate(read_jsonl(path))]
        train = task_file(path.parent / "train.jsonl", data_path)
        pool = (
            [self._normalize(d, str(train)) for d in read_jsonl(train)] if train.is_file() else []
        )
        return docs, pool

    @staticmethod
    def _normalize(doc: Doc, where: str) -> Doc:
        require_fields(doc, ("question", "passage"), where)
        if "label" not in doc:
            require_fields(doc, ("answer",), where)
            doc = {**doc, "label": int(bool(doc["answer"]))}
        return doc

    def doc_to_text(self, doc: Doc) -> str:
        """Passage, question and the answer cue."""
        return f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"

    def doc_to_choice(self, doc: Doc) -> list[str]:
        """No / yes, in label order."""
        return ["no", "yes"]

    def doc_to_target(self, doc: Doc) -> int:
        """1 for yes, 0 for no."""
        return int(doc["label"])


def tasks() -> list[BoolQ]:
    """The registry entries of this file."""
    return [BoolQ(summary="BoolQ: yes/no questions about a passage (SuperGLUE validation)")]
