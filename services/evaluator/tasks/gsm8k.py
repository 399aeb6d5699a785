"""GSM8K (Cobbe et al., 2021), grade-school math word problems, in lm-eval's two main forms.

- `gsm8k`: 5-shot "Question: {question}\\nAnswer: {full reference solution}" examples drawn by
  lm-eval's seeded random sampler from `train.jsonl`, generation until "Question:", and
  exact_match of the number after "####" (strict-match) or of the last number in the answer
  (flexible-extract).
- `gsm8k_cot`: 8-shot chain of thought (Wei et al., 2022), "Q: {question}\\nA:" after the 8
  published exemplars, generation until "Q:", and exact_match of the number after
  "The answer is" (strict-match) or of the last number (flexible-extract).

Both compare against the number after "####" in the reference solution. Data: the published
`test.jsonl` (fields `question`, `answer`), or any `*.jsonl` given directly; `gsm8k` also needs
`train.jsonl` beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.evaluator.scoring.filters import RegexFilter
from services.evaluator.tasks.base import (
    Doc,
    MissingData,
    find_file,
    read_jsonl,
    require_fields,
    task_file,
)
from services.evaluator.tasks.catalog import catalog
from services.evaluator.tasks.generation import GenerationTask

LAST_NUMBER = RegexFilter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
"""flexible-extract: the last number-like span of the answer."""
REGEXES_TO_IGNORE = (",", "\\$", "(?s).*#### ", "\\.$")
"""exact_match: thousands separators, dollars, the solution before "####", a final period."""


def _plain_filters() -> dict[str, RegexFilter | None]:
    return {
        "strict-match": RegexFilter(r"#### (\-?[0-9\.\,]+)"),
        "flexible-extract": LAST_NUMBER,
    }


def _cot_filters() -> dict[str, RegexFilter | None]:
    return {
        "strict-match": RegexFilter(r"The answer is (\-?[0-9\.\,]+)."),
        "flexible-extract": LAST_NUMBER,
    }


def read_problems(path: Path) -> list[Doc]:
    """GSM8K records of `path`, each checked for `question` and `answer`."""
    docs = read_jsonl(path)
    for number, doc in enumerate(docs, 1):
        require_fields(doc, ("question", "answer"), f"{path}:{number}")
    return docs


def find_test_file(data_path: Path, task: str) -> Path:
    """The test split: `test.jsonl` under the data path or `gsm8k/` (or the file given)."""
    return find_file(data_path, ["test.jsonl", "main/test.jsonl"], task, "gsm8k")


@dataclass
class GSM8K(GenerationTask):
    """GSM8K test split, 5-shot from the train split (lm-eval's `gsm8k`)."""

    name: str = "gsm8k"
    summary: str = "GSM8K grade-school math, 5-shot from train (exact match)"
    version: str = "3.0"
    default_num_fewshot: int = 5
    sampler: str = "random"
    until: tuple[str, ...] = ("Question:", "</s>", "<|im_end|>")
    filters: dict[str, RegexFilter | None] = field(default_factory=_plain_filters)
    regexes_to_ignore: tuple[str, ...] = REGEXES_TO_IGNORE
    ignore_case: bool = True

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """Test problems, and the train problems beside them as the few-shot pool."""
        test = find_test_file(data_path, self.name)
        train = task_file(test.with_name("train.jsonl"), data_path)
        if test.name == train.name or not train.is_file():
            raise MissingData(
                f"--task-data-path {data_path}: task {self.name} draws its few-shot examples "
                f"from the train split; put GSM8K's train.jsonl at {train} (beside the test file "
                f"{test.name}), or use gsm8k_cot, whose exemplars ship with Meshline"
            )
        return read_problems(test), read_problems(train)

    def doc_to_text(self, doc: Doc) -> str:
        """Question and the answer cue."""
        return f"Question: {doc['question']}\nAnswer:"

    def doc_to_target(self, doc: Doc) -> str:
        """The full reference solution (ending in "#### n"); exact_match keeps only n."""
        return str(doc["answer"])


@dataclass
class GSM8KCoT(GenerationTask):
    """GSM8K test split, 8-shot chain of thought."""

    name: str = "gsm8k_cot"
    summary: str = "GSM8K grade-school math, 8-shot chain of thought (exact match)"
    version: str = "3.0"
    default_num_fewshot: int = 8
    until: tuple[str, ...] = ("Q:", "</s>", "<|im_end|>")
    filters: dict[str, RegexFilter | None] = field(default_factory=_cot_filters)
    regexes_to_ignore: tuple[str, ...] = REGEXES_TO_IGNORE
    ignore_case: bool = True

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """Test problems; the few-shot exemplars are the published chain-of-thought ones."""
        return read_problems(find_test_file(data_path, self.name)), list(catalog()["gsm8k_cot"])

    def doc_to_text(self, doc: Doc) -> str:
        """Question and the answer cue."""
        return f"Q: {doc['question']}\nA:"

    def doc_to_target(self, doc: Doc) -> str:
        """The final number of a reference solution, or an exemplar's worked answer."""
        if "answer" in doc:
            return str(doc["answer"]).split("####")[-1].strip()
        return str(doc["target"])


def tasks() -> list[GenerationTask]:
    """The registry entries of this file."""
    return [GSM8K(), GSM8KCoT()]
