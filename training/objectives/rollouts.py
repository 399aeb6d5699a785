"""What the online-RL objectives read: rollout batches, and where their completions come from.

Shapes: N sequences (P prompts x G generations, a prompt's generations in consecutive rows),
S positions. A rollout batch holds `input_ids` [N, S] (each row its prompt then its completion,
right-padded), `completion_mask` [N, S] (1 on completion tokens, aligned with the ids) and
`advantages` [N] (GRPO; PPO computes its own); optionally `old_logps` / `ref_logps` [N, S-1]
(log-probabilities of the tokens at positions 1..S-1 under the sampling policy and the
reference) and `rewards` [N]. Fixed rollouts (tests, parity with trl) arrive as such batches.

Online, a micro-batch is a prompt batch instead: `prompt_ids` [P, L] right-padded with
`prompt_length` [P], `prompt_index` [P] (the prompt's row in its set, for the reward's
reference answer) and `seed` [P] (the sampler's seed, from the sample's position in the run, so
a resumed run draws the same completions). A `RolloutSource` generates the completions (the
engine, reading the policy's weights in place; training does not import the engine, the caller
hands one in) and a `RewardFn` scores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

ROLLOUT_KEYS = ("input_ids", "completion_mask")
PROMPT_KEYS = ("prompt_ids", "prompt_length", "prompt_index", "seed")


class Completion(Protocol):
    """One generated continuation (the engine's `SequenceResult` is one)."""

    token_ids: list[int]
    """New tokens (EOS included when produced)."""
    text: str
    """Their text (empty without a tokenizer)."""


@dataclass(frozen=True)
class Sample:
    """What a reward function sees of one completion."""

    prompt_ids: list[int]
    """The prompt's tokens."""
    completion: Completion
    """The generated continuation."""
    record: dict[str, Any]
    """The prompt's row in its set (e.g. its reference `answer`)."""


class RolloutSource(Protocol):
    """Generates completions with the policy's current weights."""

    def generate(
        self, model: nn.Module, prompts: Sequence[list[int]], seeds: Sequence[int], n: int
    ) -> list[list[Completion]]:
        """`n` sampled completions per prompt, the sampler of prompt i seeded with seeds[i]."""
        ...


class RewardFn(Protocol):
    """Scores completions: one float per sample."""

    def __call__(self, samples: Sequence[Sample]) -> torch.Tensor:
        """Rewards [N] (fp32) of `samples`."""
        ...


def is_rollout_batch(batch: dict[str, torch.Tensor]) -> bool:
    """Whether `batch` holds finished rollouts (else it must be a prompt batch)."""
    return all(key in batch for key in ROLLOUT_KEYS)


def check_prompt_batch(batch: dict[str, torch.Tensor], stage: str) -> None:
    """Refuse a micro-batch that is neither rollouts nor prompts."""
    missing = [key for key in PROMPT_KEYS if key not in batch]
    if missing:
        raise ValueError(
            f"--stage {stage} trains on prompts (a prompt set, docs/alignment.md) or finished "
            f"rollouts ({', '.join(ROLLOUT_KEYS)}); this batch lacks {missing}"
        )


def prompt_lists(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each prompt's tokens, padding dropped."""
    ids, lengths = batch["prompt_ids"].tolist(), batch["prompt_length"].tolist()
    return [row[:length] for row, length in zip(ids, lengths, strict=True)]


def pack_rollouts(
    prompts: Sequence[list[int]],
    completions: Sequence[Sequence[Completion]],
    pad_id: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """`input_ids` and `completion_mask` [N, S] of every prompt's completions, in order."""
    rows = [
        (prompt, completion.token_ids)
        for prompt, group in zip(prompts, completions, strict=True)
        for completion in group
    ]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        end = len(prompt) + len(completion)
        ids[i, :end] = torch.tensor(prompt + completion, dtype=torch.long)
        mask[i, len(prompt) : end] = 1
    return {"input_ids": ids.to(device), "completion_mask": mask.to(device)}


def samples_of(
    prompts: Sequence[list[int]],
    completions: Sequence[Sequence[Completion]],
    records: Sequence[dict[str, Any]],
) -> list[Sample]:
    """One `Sample` per completion, prompt by prompt."""
    return [
        Sample(prompt, completion, record)
        for prompt, group, record in zip(prompts, completions, records, strict=True)
        for completion in group
    ]
