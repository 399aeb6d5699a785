"""A policy's win rate against its reference under a reward model: `rm_win_rate`.

Data: a JSON-lines file of prompts (`rm_win_rate*.jsonl` or `prompts*.jsonl` under
--task-data-path or its `rm_win_rate/` folder, or the file itself), one record per line with a
plain-text `prompt` (a string; other fields are ignored). Three models take part: the evaluated
model (the policy, `--load` / `--endpoint`), the reference (`--reference-load` /
`--reference-endpoint`) and a reward model (`--reward-load` / `--reward-endpoint`). Both causal
LMs answer every prompt greedily (the prompt encoded as generation tasks encode it, at most
--max-new-tokens tokens, default 64, ending at EOS); the reward model scores (prompt, answer) for
both answers, encoded exactly as `rm_pairs` encodes a pair (services/evaluator/models/base.py
`LanguageModel.reward`). Per prompt:

- `win_rate`: 1 when r(policy) > r(reference), 0.5 on a tie, else 0;
- `reward_margin`: r(policy) - r(reference).

The task reports their means. Few-shot examples mean nothing here: --num-fewshot other than 0 is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.evaluator.tasks.base import Doc, MetricSpec, Task, find_file, text_records

REWARD_WIN_RATE = "reward_win_rate"
"""Output type: each doc asks both causal LMs for an answer, then the reward model for both."""
DEFAULT_MAX_NEW_TOKENS = 64
"""Tokens each model generates at most when --max-new-tokens is not given."""
MAX_PROMPT_CHARS = 100_000
"""Longest prompt accepted (a bound on untrusted input; the context cut applies after)."""


@dataclass
class RewardWinRate(Task):
    """Prompts answered by a policy and its reference, judged by a reward model."""

    name: str = "rm_win_rate"
    version: str = "1.0"
    output_type: str = REWARD_WIN_RATE
    metrics: tuple[MetricSpec, ...] = field(
        default_factory=lambda: (MetricSpec("win_rate"), MetricSpec("reward_margin"))
    )

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """The prompts file's records (checked); no few-shot pool."""
        path = find_file(
            data_path, ["rm_win_rate*.jsonl", "prompts*.jsonl"], self.name, "rm_win_rate"
        )
        records = text_records(
            path,
            ("prompt",),
            max_chars=MAX_PROMPT_CHARS,
            need="a plain-text prompt",
            non_empty=("prompt",),
        )
        docs: list[Doc] = [record for _, record in records]
        return docs, []

    def doc_to_text(self, doc: Doc) -> str:
        """The prompt."""
        return str(doc["prompt"])

    def doc_to_target(self, doc: Doc) -> str:
        """No gold answer: the reward model judges (empty)."""
        return ""

    def process(self, doc: Doc, answers: Any) -> dict[str, float]:
        """win_rate and reward_margin from `answers` = [policy answer, reference answer,
        r(policy), r(reference)]."""
        _, _, policy, reference = answers
        policy, reference = float(policy), float(reference)
        win = 1.0 if policy > reference else 0.5 if policy == reference else 0.0
        return {"win_rate,none": win, "reward_margin,none": policy - reference}


def tasks() -> list[RewardWinRate]:
    """The registry entries of this file."""
    return [
        RewardWinRate(
            summary="A policy's win rate and mean reward margin against its reference, judged "
            "by a reward model"
        )
    ]
