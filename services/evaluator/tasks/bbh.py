"""BIG-Bench Hard (Suzgun et al., 2022): 27 reasoning tasks, 3-shot answer-only, as lm-eval's
`bbh_fewshot_*`: the task description, the 3 published exemplars "Q: {input}\\nA: {target}",
then "Q: {input}\\nA:", generation until "Q" or a blank line, exact_match of the raw answer.

Data: the published per-task files `{task}.json` (`{"examples": [{"input", "target"}, ...]}`);
`{task}.jsonl` with the same records is accepted too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.evaluator.tasks.base import (
    Doc,
    find_file,
    open_task_file,
    read_jsonl,
    require_fields,
)
from services.evaluator.tasks.catalog import catalog
from services.evaluator.tasks.generation import GenerationTask


@dataclass
class BBHTask(GenerationTask):
    """One BBH task with its published 3-shot exemplars."""

    dataset: str = ""
    version: str = "2.0"
    default_num_fewshot: int = 3
    until: tuple[str, ...] = ("</s>", "Q", "\n\n")

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """The task's examples, and the published exemplars as the few-shot pool."""
        path = find_file(
            data_path,
            [f"{self.dataset}.json", f"*/{self.dataset}.json", f"{self.dataset}.jsonl"],
            self.name,
            "bbh",
        )
        if path.suffix == ".json":
            with open_task_file(path) as fh:
                payload = json.loads(fh.read())
            if not isinstance(payload, dict) or not isinstance(payload.get("examples"), list):
                raise ValueError(f'{path}: expected {{"examples": [{{input, target}}, ...]}}')
            docs = payload["examples"]
        else:
            docs = read_jsonl(path)
        for number, doc in enumerate(docs, 1):
            require_fields(doc, ("input", "target"), f"{path}: example {number}")
        return docs, list(catalog()["bbh"][self.dataset]["shots"])

    def doc_to_text(self, doc: Doc) -> str:
        """Question and the answer cue."""
        return f"Q: {doc['input']}\nA:"

    def doc_to_target(self, doc: Doc) -> str:
        """The reference answer."""
        return str(doc["target"])


def tasks() -> list[BBHTask]:
    """One task per BBH subtask in the group "bbh"."""
    return [
        BBHTask(
            name=f"bbh_fewshot_{dataset}",
            dataset=dataset,
            summary=f"BIG-Bench Hard {dataset.replace('_', ' ')} (3-shot)",
            group="bbh",
            description=entry["description"],
        )
        for dataset, entry in catalog()["bbh"].items()
    ]
