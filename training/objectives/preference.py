"""What the preference objectives (`rm`, `dpo`) share: pair counting, tokens, logged means."""

from __future__ import annotations

import torch

from training.objectives.base import Objective
from training.objectives.preference_losses import PairTerms

PAIRS_METRIC = "pairs"
"""The metric sum every preference objective logs: pairs scored (the divisor of the means)."""


class PairwiseObjective(Objective):
    """An objective over preference pairs (training/objectives/pairs.py's batch)."""

    def count(self, batch: dict[str, torch.Tensor]) -> float:
        """Pairs in the micro-batch."""
        return float(batch["chosen_input_ids"].shape[0])

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Both sides' token positions."""
        return int(batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel())

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Means per pair, as trl logs them (accuracies as a fraction)."""
        pairs = sums.get(PAIRS_METRIC, 0.0)
        if pairs <= 0:
            return {}
        return {name: value / pairs for name, value in sums.items() if name != PAIRS_METRIC}


def reward_metrics(
    terms: PairTerms, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor
) -> dict[str, float]:
    """trl's logged quantities of a policy-preference loss, as sums (with `pairs`)."""
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    return {
        PAIRS_METRIC: float(chosen.shape[0]),
        "rewards/chosen": float(chosen.sum()),
        "rewards/rejected": float(rejected.sum()),
        "rewards/accuracies": float((chosen > rejected).sum()),
        "rewards/margins": float((chosen - rejected).sum()),
        "logps/chosen": float(chosen_logps.detach().sum()),
        "logps/rejected": float(rejected_logps.detach().sum()),
    }
