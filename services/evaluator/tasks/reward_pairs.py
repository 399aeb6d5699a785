"""Reward-model accuracy on held-out preference pairs (RewardBench's measure): `rm_pairs`.

Data: a JSON-lines file of pairs (`rm_pairs*.jsonl` or `pairs*.jsonl` under --task-data-path or
its `rm_pairs/` folder, or the file itself), one record per line in trl's explicit-prompt
preference format with plain text, the layout `meshline preprocess --handler-name preference`
reads: `prompt`, `chosen`, `rejected` (strings). Each side is encoded as that handler encodes a
plain-text pair (services/evaluator/models/base.py `LanguageModel.reward`) and scored by the
reward model (its last token's value); per pair:

- `acc`: 1 when r(chosen) > r(rejected) (strictly, as RewardBench counts), else 0;
- `margin`: r(chosen) - r(rejected).

The task reports their means. Few-shot examples mean nothing here: --num-fewshot other than 0 is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.evaluator.tasks.base import Doc, MetricSpec, Task, find_file, text_records

REWARD_PAIRS = "reward_pairs"
"""Output type: each doc asks for the rewards of (prompt, chosen) and (prompt, rejected)."""
FIELDS = ("prompt", "chosen", "rejected")
MAX_TEXT_CHARS = 100_000
"""Longest prompt or response accepted (a bound on untrusted input, as rm_win_rate's prompts)."""


@dataclass
class RewardPairs(Task):
    """Preference pairs scored by a reward model: accuracy and mean margin."""

    name: str = "rm_pairs"
    version: str = "1.0"
    output_type: str = REWARD_PAIRS
    metrics: tuple[MetricSpec, ...] = field(
        default_factory=lambda: (MetricSpec("acc"), MetricSpec("margin"))
    )

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """The pairs file's records (checked); no few-shot pool."""
        path = find_file(data_path, ["rm_pairs*.jsonl", "pairs*.jsonl"], self.name, "rm_pairs")
        docs = []
        need = f"{list(FIELDS)}, plain text"
        for where, record in text_records(path, FIELDS, max_chars=MAX_TEXT_CHARS, need=need):
            if not record["chosen"] or not record["rejected"]:
                raise ValueError(f"{where}: an empty response (chosen or rejected)")
            if record["chosen"] == record["rejected"]:
                raise ValueError(f"{where}: chosen equals rejected")
            docs.append(record)
        return docs, []

    def doc_to_text(self, doc: Doc) -> str:
        """The prompt."""
        return str(doc["prompt"])

    def doc_to_target(self, doc: Doc) -> str:
        """The preferred response."""
        return str(doc["chosen"])

    def requests(self, doc: Doc) -> list[list[str]]:
        """(prompt, response) for the chosen, then the rejected response."""
        return [[doc["prompt"], doc["chosen"]], [doc["prompt"], doc["rejected"]]]

    def process(self, doc: Doc, answers: Any) -> dict[str, float]:
        """acc and margin from `answers` = [r(chosen), r(rejected)]."""
        chosen, rejected = (float(a) for a in answers)
        return {"acc,none": float(chosen > rejected), "margin,none": chosen - rejected}


def tasks() -> list[RewardPairs]:
    """The registry entries of this file."""
    return [
        RewardPairs(summary="Reward-model accuracy and mean margin on prompt/chosen/rejected pairs")
    ]
