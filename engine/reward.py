"""Reward scores of a reward model (a scalar value head, `meshline train --stage rm`), batched.

Shapes: B inputs in a batch, S padded length.

A reward model's forward gives one score per position ([B, S, 1], models/value_head.py); an
input's reward is the score of its last token, the token `--stage rm` read during training and
the one transformers' `...ForSequenceClassification` reads on the HF export (its last non-pad
token: the same unless an input ends in the pad id). Inputs are right-padded and batched longest
first under a token budget; the attention is causal, so the padding after an input's last token
never reaches its score, and no key mask is needed (the training objective runs the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.value_head import has_value_head


@dataclass(frozen=True)
class RewardLimits:
    """The bounds one reward request meets (the server's flags) and the model's capacity."""

    max_inputs: int
    """Most inputs per request (--max-score-items)."""
    max_tokens: int
    """Most tokens of all inputs together (--max-score-tokens)."""
    max_model_len: int
    """Longest input in tokens (--max-model-len, else the model's context length)."""
    vocab_size: int
    """Every id must be below it."""


def reward_input_problems(rows: list[list[int]], limits: RewardLimits) -> list[tuple[str, str]]:
    """(field, reason) for each input that cannot be scored: empty, too long, ids outside the
    vocabulary, too many inputs or tokens in all. Field names are `inputs[i]`."""
    out: list[tuple[str, str]] = []
    if not rows:
        return [("inputs", "give at least one input to score")]
    if len(rows) > limits.max_inputs:
        return [
            (
                "inputs",
                f"at most {limits.max_inputs} inputs per request (--max-score-items), "
                f"got {len(rows)}",
            )
        ]
    for i, row in enumerate(rows):
        if not row:
            out.append((f"inputs[{i}]", "encodes to no tokens; give a non-empty input"))
        elif len(row) > limits.max_model_len:
            out.append(
                (
                    f"inputs[{i}]",
                    f"is {len(row)} tokens, over the server's model length "
                    f"{limits.max_model_len} (--max-model-len)",
                )
            )
        elif min(row) < 0 or max(row) >= limits.vocab_size:
            bad = [t for t in row if not 0 <= t < limits.vocab_size][:5]
            out.append((f"inputs[{i}]", f"token ids {bad} are outside [0, {limits.vocab_size})"))
        if len(out) >= 20:  # the error stays readable
            return out
    total = sum(len(r) for r in rows)
    if not out and total > limits.max_tokens:
        out.append(
            (
                "inputs",
                f"the inputs hold {total} tokens in all, at most {limits.max_tokens} per "
                "request (--max-score-tokens); split them over several requests",
            )
        )
    return out


class RewardScorer:
    """Scores token sequences with a value-head model on its device (call from one thread)."""

    def __init__(self, model: nn.Module, *, pad_id: int = 0, max_batch_tokens: int = 8192) -> None:
        if not has_value_head(model):
            raise ValueError("RewardScorer: the model has no scalar value head (--stage rm)")
        self.model = model.eval()
        self.pad_id = pad_id
        self.max_batch_tokens = max_batch_tokens
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def score(self, rows: list[list[int]]) -> list[float]:
        """One reward per non-empty row of ids (its last token's score), in fp32."""
        rewards: list[float] = [0.0] * len(rows)
        # Longest first, so each batch pads little and the token budget holds.
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        start = 0
        while start < len(order):
            longest = len(rows[order[start]])
            batch = order[start : start + max(1, self.max_batch_tokens // longest)]
            start += len(batch)
            ids_BS = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
            for r, i in enumerate(batch):
                ids_BS[r, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
            last_B = torch.tensor([len(rows[i]) - 1 for i in batch])
            scores_BS1 = self.model(ids_BS.to(self.device))
            picked_B = scores_BS1[torch.arange(len(batch)), last_B.to(self.device), 0]
            for i, value in zip(batch, picked_B.float().cpu().tolist(), strict=True):
                rewards[i] = float(value)
        return rewards
