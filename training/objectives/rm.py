"""`rm`: a reward model trained on preference pairs (the pairwise Bradley-Terry loss).

Shapes: B pairs, S sequence. The model carries a scalar value head (`models.value_head`), so its
forward returns a score per position; a response's reward is the score of its last real token,
chosen and rejected scored in one forward. The loss is `preference_losses.reward_pair_loss` with
the batch's optional `margin`; the logged sums are the accuracy and margin trl's RewardTrainer
reports (divide by `pairs` for its means).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.transformer import CausalLM
from models.value_head import attach_value_head, has_value_head
from training.objectives.base import ForwardContext, ObjectiveOutput
from training.objectives.pairs import concatenated, last_token_index
from training.objectives.preference import PairwiseObjective, pair_forward
from training.objectives.preference_losses import reward_pair_loss


def pair_rewards(
    model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards [B] each, in fp32: the last real token's score."""
    with ctx.autocast():
        scores_BS1 = pair_forward(model, concatenated(batch, "input_ids"), ctx)
    return last_token_rewards(scores_BS1, batch, ctx)


def last_token_rewards(
    scores_BS1: torch.Tensor, batch: dict[str, torch.Tensor], ctx: ForwardContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards [B] each from the concatenated pair's scores [2B,S,1]."""
    if isinstance(scores_BS1, DTensor):  # a sequence-parallel head's output: gather it
        scores_BS1 = scores_BS1.full_tensor()
    attention = concatenated(batch, "attention_mask")
    last = last_token_index(attention)
    rows = torch.arange(attention.shape[0], device=scores_BS1.device)
    rewards = scores_BS1[rows, last.to(scores_BS1.device), 0].float()
    chosen, rejected = rewards.chunk(2)
    return chosen, rejected


class RewardLoss(PairwiseObjective):
    """Summed pairwise reward loss, normalised by the pair count."""

    name: ClassVar[str] = "rm"
    metric_names: ClassVar[tuple[str, ...]] = (
        "pairs",
        "accuracy",
        "margin",
        "rewards/chosen",
        "rewards/rejected",
    )

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The registry model with its vocabulary head replaced by a scalar value head."""
        assert isinstance(model, CausalLM), "the registry builds CausalLM models"
        return attach_value_head(model, seed=self.seed)

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Score both responses in one forward (`score`)."""
        if not has_value_head(model) and getattr(model, "runner", None) is None:
            raise ValueError(
                f"--stage {self.name} trains a reward model: the model needs a scalar value head "
                "(models.value_head.attach_value_head)"
            )
        return super().compute(model, batch, ctx)

    def score(
        self, output: torch.Tensor, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """−log σ(r_w − r_l − margin) per pair, r the last real token's score."""
        chosen, rejected = last_token_rewards(output, batch, ctx)
        margin = batch["margin"].float() if "margin" in batch else 0.0
        losses = reward_pair_loss(chosen, rejected, margin)
        chosen, rejected = chosen.detach(), rejected.detach()
        metrics = {
            "pairs": float(chosen.shape[0]),
            "accuracy": float((chosen > rejected).sum()),
            "margin": float((chosen - rejected).sum()),
            "rewards/chosen": float(chosen.sum()),
            "rewards/rejected": float(rejected.sum()),
        }
        return ObjectiveOutput(losses.sum(), metrics)
