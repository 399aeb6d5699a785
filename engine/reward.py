"""Reward scores of a reward model (a scalar value head, `meshline train --stage rm`), batched.

Shapes: B inputs in a batch, S padded length.

A reward model's forward gives one score per position ([B, S, 1], models/value_head.py); an
input's reward is the score of its last token, the token `--stage rm` read during training and
the one transformers' `...ForSequenceClassification` reads on the HF export (its last non-pad
token: the same unless an input ends in the pad id). Inputs are right-padded and batched longest
first under a token budget; the attention is causal, so the padding after an input's last token
never reaches its score, and no key mask is needed (the training objective runs the same way).
What a request may hold is judged by `engine.validation.reward_problems` (both serving fronts).
"""

from __future__ import annotations

import torch
from torch import nn

from models.value_head import has_value_head


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
