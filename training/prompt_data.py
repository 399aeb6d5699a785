"""Prompt sets for online RL (`--stage grpo|ppo`): a JSON-lines file of prompts and answers.

Each line is an object with `prompt` (text) and optionally `answer` (what the verifiable rewards
compare with) and any other fields the rewards may read. `--data-path FILE.jsonl` names it (one
file; `--valid-data-path` optionally another for evaluation). The prompts are tokenised once
with the run's tokenizer (special tokens as it adds them, as the inference service encodes a
text prompt). Sample i of the run is prompt
order[i mod n], `order` a permutation drawn from --seed per pass, and its rollout seed is
derived from i, so a resumed run (which continues at its consumed samples) draws the same
prompts and the same completions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.tokenizer import Tokenizer

MAX_PROMPTS = 1_000_000
"""Most prompts read from one file."""
MAX_LINE_BYTES = 1 << 20
"""Longest line accepted (bytes)."""
SEED_STRIDE = 1_000_003
"""Sample i's rollout seed is seed * SEED_STRIDE + i * SAMPLE_SEEDS (mod 2**62)."""
SAMPLE_SEEDS = 1 << 16
"""Seeds each sample owns: its completions j = 0, 1, ... seed their samplers seed + j, so two
samples' completions never share a seed (--num-generations stays below this)."""


def read_prompts(path: str | Path, flag: str = "--data-path") -> list[dict[str, Any]]:
    """The records of a prompt file; ValueError naming the file and line at fault."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"{flag} {path}: no such file; --stage grpo/ppo read a JSON-lines prompt file "
            '(one {"prompt": ..., "answer": ...} per line)'
        )
    records: list[dict[str, Any]] = []
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f'{path}:{number}: needs a "prompt" string field')
            if not record["prompt"]:
                raise ValueError(f"{path}:{number}: the prompt is empty")
            records.append(record)
            if len(records) > MAX_PROMPTS:
                raise ValueError(f"{path}: more than {MAX_PROMPTS} prompts")
    if not records:
        raise ValueError(f"{flag} {path}: no prompts in the file")
    return records


@dataclass
class PromptSet:
    """Tokenised prompts and their records."""

    records: list[dict[str, Any]]
    """Each prompt's line (its `answer` and any other fields)."""
    ids: list[list[int]]
    """Each prompt's tokens."""
    tokenizer: Tokenizer
    """The run's tokenizer (the rollouts decode completions with it)."""
    pad_id: int
    """Padding id of prompt and rollout rows."""
    max_length: int
    """Width of a prompt row (--max-prompt-length)."""


def tokenize_prompts(
    records: list[dict[str, Any]], tokenizer: Tokenizer, max_length: int, path: str
) -> PromptSet:
    """Encode every prompt; one longer than `max_length` tokens is an error naming its line."""
    ids = []
    for number, record in enumerate(records, 1):
        tokens = tokenizer.encode(record["prompt"], add_special_tokens=True)
        if len(tokens) > max_length:
            raise ValueError(
                f"{path}: prompt {number} has {len(tokens)} tokens, over --max-prompt-length "
                f"{max_length}; raise it or shorten the prompt"
            )
        ids.append(list(tokens))
    return PromptSet(records, ids, tokenizer, tokenizer.pad_id, max_length)


class PromptDataset:
    """`samples` prompt rows over a `PromptSet` (training/objectives/rollouts.py's prompt batch)."""

    def __init__(self, prompts: PromptSet, samples: int, seed: int) -> None:
        self.prompts = prompts
        self.samples = samples
        self.seed = seed

    @property
    def records(self) -> list[dict[str, Any]]:
        """The prompts' records (the rewards read them by `prompt_index`)."""
        return self.prompts.records

    @property
    def pad_id(self) -> int:
        """Padding id."""
        return self.prompts.pad_id

    def __len__(self) -> int:
        return self.samples

    def _order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self.prompts.ids), generator=generator)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        count = len(self.prompts.ids)
        prompt = int(self._order(index // count)[index % count])
        tokens = self.prompts.ids[prompt]
        row = torch.full((self.prompts.max_length,), self.prompts.pad_id, dtype=torch.long)
        row[: len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return {
            "prompt_ids": row,
            "prompt_length": torch.tensor(len(tokens)),
            "prompt_index": torch.tensor(prompt),
            "seed": torch.tensor((self.seed * SEED_STRIDE + index * SAMPLE_SEEDS) % 2**62),
        }
