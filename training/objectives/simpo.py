"""`simpo`: SimPO, preference optimisation without a reference model.

Shapes: B pairs, S sequence. The policy scores chosen and rejected in one forward; each side's
log-probability is averaged over its response tokens (the length normalisation that lets SimPO
drop the reference), and the loss is `preference_losses.simpo_loss` with γ = --gamma-beta-ratio
x --simpo-beta (MindSpeed-LLM's flags). Logged: trl's quantities (rewards are β times the
averaged log-probabilities, `logps/*` the averages, as trl's CPOTrainer logs them).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from training.objectives.base import ForwardContext, ObjectiveOutput
from training.objectives.pairs import concatenated, sequence_logps
from training.objectives.preference import PairwiseObjective, reward_metrics
from training.objectives.preference_losses import simpo_loss


class SimPOLoss(PairwiseObjective):
    """Summed per-pair SimPO loss, normalised by the pair count."""

    name: ClassVar[str] = "simpo"

    def __init__(self, *, beta: float = 2.5, gamma_beta_ratio: float = 1.4) -> None:
        if not beta > 0:
            raise ValueError(f"--simpo-beta must be > 0, got {beta}")
        if gamma_beta_ratio < 0:
            raise ValueError(f"--gamma-beta-ratio must be >= 0, got {gamma_beta_ratio}")
        self.beta = beta
        self.gamma = gamma_beta_ratio * beta

    def score(
        self, output: torch.Tensor, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Averaged log-probabilities and the loss in fp32."""
        ids = concatenated(batch, "input_ids")
        mask = concatenated(batch, "loss_mask")
        tokens = mask[:, 1:].sum(dim=1).clamp(min=1).float()
        chosen, rejected = (sequence_logps(output, ids, mask) / tokens).chunk(2)
        terms = simpo_loss(chosen, rejected, beta=self.beta, gamma=self.gamma)
        return ObjectiveOutput(terms.losses.sum(), reward_metrics(terms, chosen, rejected))
