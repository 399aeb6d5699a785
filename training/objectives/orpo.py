"""`orpo`: ORPO, odds-ratio preference optimisation, with no reference model (trl's ORPOTrainer).

Shapes: B pairs, S sequence, V vocab. One forward scores chosen and rejected; the loss is the
chosen sequences' next-token NLL plus β times the odds-ratio term
(`preference_losses.orpo_odds_ratio`, on log-probabilities averaged over each response's
tokens). As in trl, the NLL covers every real token of the chosen sequences (prompt and
response) and is their token mean over the micro-batch: the micro-batch's sum counts it once per
pair, so a step's loss is trl's on one micro-batch and the pair-weighted mean of micro-batch
means under accumulation (as trl's own accumulation averages them).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from training.objectives.base import ForwardContext, ObjectiveOutput
from training.objectives.pairs import concatenated, sequence_logps, token_logps
from training.objectives.preference import REWARD_METRICS, PairwiseObjective, reward_metrics
from training.objectives.preference_losses import orpo_odds_ratio


class ORPOLoss(PairwiseObjective):
    """Summed per-pair ORPO loss, normalised by the pair count."""

    name: ClassVar[str] = "orpo"
    metric_names: ClassVar[tuple[str, ...]] = (
        *REWARD_METRICS,
        "nll_loss",
        "log_odds_ratio",
        "log_odds_chosen",
    )

    def __init__(self, *, beta: float = 0.1) -> None:
        if not beta > 0:
            raise ValueError(f"--orpo-beta must be > 0, got {beta}")
        self.beta = beta

    def score(
        self, output: torch.Tensor, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Log-probabilities and the loss in fp32."""
        ids = concatenated(batch, "input_ids")
        mask = concatenated(batch, "loss_mask")
        pairs = batch["chosen_input_ids"].shape[0]
        tokens = mask[:, 1:].sum(dim=1).clamp(min=1).float()
        chosen, rejected = (sequence_logps(output, ids, mask) / tokens).chunk(2)
        terms, ratio, log_odds = orpo_odds_ratio(chosen, rejected, beta=self.beta)
        if isinstance(output, DTensor):  # vocabulary-sharded: from the loss-parallel log-probs
            attention = concatenated(batch, "attention_mask")[:pairs, 1:]
            logps = token_logps(output, ids)[:pairs]
            nll = -(logps * attention).sum() / attention.sum().clamp(min=1)
        else:
            nll = chosen_nll(
                output[:pairs], batch["chosen_input_ids"], batch["chosen_attention_mask"]
            )
        metrics = reward_metrics(terms, chosen, rejected) | {
            "nll_loss": float(nll.detach()) * pairs,
            "log_odds_ratio": float(ratio.sum()),
            "log_odds_chosen": float(log_odds.sum()),
        }
        return ObjectiveOutput(terms.losses.sum() + nll * pairs, metrics)


def chosen_nll(
    logits_BSV: torch.Tensor, ids_BS: torch.Tensor, attention_BS: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross entropy over every real token after the first (fp32)."""
    labels_BS = ids_BS[:, 1:].masked_fill(attention_BS[:, 1:] == 0, -100)
    logits = logits_BSV[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels_BS.reshape(-1))
